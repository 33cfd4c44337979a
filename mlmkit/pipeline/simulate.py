"""Simulate a schedule on modelled costs: timeline, step time, bubble and in-flight microbatches.

Pure planning code. The engine is a dry run of the schedule with the executor's semantics: each
rank performs its actions in order; a send is posted without waiting (``isend``) and its message
arrives ``p2p_latency + bytes / p2p_bandwidth`` later; a receive waits until its message has
arrived. Messages carry their identity (a tag: activation or gradient, microbatch, sending stage),
so a receive gets exactly its message whatever else travels on the channel; ``ordered=True``
models a transport without tags (first sent, first received: NCCL without batching) and reports a
receive that would get another message. :func:`mlmkit.pipeline.validate` runs the same engine with
unit costs, so a schedule that passes validation cannot deadlock in the executor (the batched NCCL
path is checked by :mod:`mlmkit.pipeline.batching`).
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass, fields
from typing import AbstractSet, Iterable, Mapping, Optional, Sequence, Union

from mlmkit.pipeline.schedule import COMPUTE, Action, Schedule, ScheduleError

__all__ = ["ActionCosts", "Costs", "SimResult", "calibrate", "dry_run", "replay", "shared_run", "simulate"]

Number = Union[int, float]


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Time of each action kind (any unit; seconds when calibrated from measurements).

    ``forward``, ``backward`` and ``weight`` are a constant, a sequence with one entry per pipeline
    rank, or one per virtual stage (``p * v`` entries). ``backward`` is the backward for inputs (an
    I action), ``weight`` the weight gradients (a W): a full backward B pays ``backward + weight``.
    ``overhead`` is added to every compute action: the runtime's own work around it (the executor,
    its messages' copies), as measured by :func:`mlmkit.pipeline.calibrate.measure_overhead`. A message costs ``p2p_latency + message_bytes / p2p_bandwidth`` (``p2p_bandwidth=0``:
    infinitely fast).
    """

    forward: Union[Number, Sequence[Number]] = 0.0
    backward: Union[Number, Sequence[Number]] = 0.0
    weight: Union[Number, Sequence[Number]] = 0.0
    overhead: float = 0.0
    p2p_latency: float = 0.0
    p2p_bandwidth: float = 0.0
    message_bytes: float = 0.0

    def __post_init__(self) -> None:
        # A negative or non-finite cost gives a timeline of no real run (NaN steps, actions that end
        # before they start): refused here, naming the kind. Numbers are kept as floats and
        # per-stage costs as a list of floats, whatever they came as (numpy scalars and arrays, a
        # pandas Series: its values in order).
        for f in fields(self):
            value = getattr(self, f.name)
            per_stage = f.name in ("forward", "backward", "weight")
            if f.name == "times":         # ActionCosts: {(rank, kind, microbatch, chunk): seconds}
                values = list(value.values()) if isinstance(value, Mapping) else [None]
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                values = [value]
            elif not per_stage:
                raise ValueError(f"costs.{f.name}={value!r} must be one finite number >= 0")
            elif isinstance(value, Mapping):
                # {rank: cost}: taken in key order when the keys are 0..n-1; list(value) would read
                # the keys as the costs.
                keys = list(value)
                if any(isinstance(k, bool) or not isinstance(k, numbers.Integral) for k in keys) or \
                        sorted(int(k) for k in keys) != list(range(len(keys))):
                    raise ValueError(f"costs.{f.name}={value!r}: a mapping of costs must be keyed by rank (or "
                                     f"virtual stage) 0..n-1; or give a list with one cost per rank, in order")
                values = [v for _, v in sorted((int(k), v) for k, v in value.items())]
            elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise ValueError(f"costs.{f.name}={value!r} must be a number or a sequence of numbers (one per "
                                 f"rank or per virtual stage)")
            else:
                values = list(value)
            for v in values:
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"costs.{f.name}={value!r}: every cost must be a finite number >= 0")
            if f.name == "times":
                continue
            if isinstance(value, numbers.Real):
                object.__setattr__(self, f.name, float(value))
            else:
                if not values:
                    raise ValueError(f"costs.{f.name}={value!r} is empty: give a number, or one cost per rank "
                                     f"or per virtual stage")
                object.__setattr__(self, f.name, [float(v) for v in values])

    @classmethod
    def from_mapping(cls, costs: Union["Costs", Mapping]) -> "Costs":
        if isinstance(costs, Costs):
            return costs
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(costs) - known)
        if unknown:
            raise ValueError(f"unknown cost kind(s) {unknown}; expected some of {sorted(known)}")
        return cls(**dict(costs))

    def _of(self, kind: str, schedule: Schedule, rank: int, chunk: int) -> float:
        value = getattr(self, kind)
        if isinstance(value, float):
            return value
        values = value
        if len(values) == schedule.stages:
            return float(values[rank])
        if len(values) == schedule.virtual_stages:
            return float(values[schedule.virtual_stage(rank, chunk)])
        raise ValueError(
            f"costs.{kind} has {len(values)} entries; expected 1 value, {schedule.stages} (one per rank) "
            f"or {schedule.virtual_stages} (one per virtual stage)"
        )

    def duration(self, schedule: Schedule, rank: int, action: Action) -> float:
        if action.kind == "F":
            return self._of("forward", schedule, rank, action.chunk) + self.overhead
        if action.kind == "B":        # a full backward: input and weight gradients
            return (self._of("backward", schedule, rank, action.chunk) + self._of("weight", schedule, rank, action.chunk)
                    + self.overhead)
        if action.kind == "I":
            return self._of("backward", schedule, rank, action.chunk) + self.overhead
        if action.kind == "W":
            return self._of("weight", schedule, rank, action.chunk) + self.overhead
        return 0.0

    def message_time(self) -> float:
        bw = self.p2p_bandwidth
        return self.p2p_latency + (self.message_bytes / bw if bw else 0.0)


def _pipeline_rows(timeline, schedule: Schedule, ranks: Optional[Sequence[int]], who: str):
    """The rows of one pipeline, numbered by stage: with ``ranks`` (its global ranks, stage by
    stage) the other rows are left out; without, every rank must already be a pipeline rank (a
    tensor- or data-parallel peer's rows would otherwise pass for another stage's)."""
    if ranks is None:
        extra = sorted({int(r) for r in timeline["rank"]} - set(range(schedule.stages)))
        if extra:
            raise ValueError(f"{who}: the timeline has rows of rank(s) {extra}, the schedule {schedule.stages} "
                             f"pipeline ranks: pass ranks= one pipeline's global ranks, stage by stage "
                             f"(topology.groups('pp')[0])")
        return timeline
    if isinstance(ranks, (AbstractSet, Mapping)):
        # A set has no order: {0, 4, 8, 12} iterates 0, 8, 4, 12, and stage 1 would read rank 8's rows.
        raise ValueError(f"{who}: ranks={ranks!r} is unordered; give one pipeline's global ranks as a list, stage "
                         f"by stage (topology.groups('pp')[0])")
    ranks = [int(r) for r in ranks]
    if len(ranks) != schedule.stages:
        raise ValueError(f"{who}: ranks={ranks} name {len(ranks)} stages, the schedule has {schedule.stages}: "
                         f"pass one pipeline's ranks, stage by stage (topology.groups('pp')[0])")
    stage_of = {r: s for s, r in enumerate(ranks)}
    timeline = timeline[timeline["rank"].isin(ranks)]
    return timeline.assign(rank=timeline["rank"].map(stage_of))


def calibrate(timeline, schedule: Schedule, *, ranks: Optional[Sequence[int]] = None, statistic: str = "median",
              p2p_latency: float = 0.0) -> Costs:
    """:class:`Costs` per virtual stage from a measured timeline (rows rank, action, chunk, start,
    end: a trace's ``events`` or a :func:`simulate` timeline). ``forward`` from F, ``backward``
    from I (or from B minus ``weight`` when the timeline has no split backward), ``weight`` from W.
    ``statistic``: "median", "mean" or "min" of each action's durations. ``ranks``: as for
    :func:`replay` (one pipeline's global ranks, stage by stage; ``None``: the timeline's ranks
    are pipeline ranks)."""
    import pandas as pd  # noqa: F401  (timeline is a DataFrame)

    timeline = _pipeline_rows(timeline, schedule, ranks, "calibrate")
    tl = timeline.assign(d=timeline.end - timeline.start)
    tl = tl.assign(vs=[schedule.virtual_stage(int(r), int(c)) for r, c in zip(tl["rank"], tl["chunk"])])
    stat = {"median": "median", "mean": "mean", "min": "min"}[statistic]

    def per_stage(kind):
        part = tl[tl.action == kind]
        values = part.groupby("vs").d.agg(stat)
        return [float(values.get(v, float("nan"))) for v in range(schedule.virtual_stages)]

    fwd, full, inp, wgt = per_stage("F"), per_stage("B"), per_stage("I"), per_stage("W")
    backward, weight = [], []
    for v in range(schedule.virtual_stages):
        w = wgt[v] if wgt[v] == wgt[v] else 0.0
        b = inp[v] if inp[v] == inp[v] else (full[v] - w if full[v] == full[v] else 0.0)
        backward.append(b)
        weight.append(w)
    return Costs(forward=fwd, backward=backward, weight=weight, p2p_latency=p2p_latency)


@dataclass(frozen=True, kw_only=True)
class ActionCosts(Costs):
    """Each compute action's own time, keyed ``(rank, kind, microbatch, chunk)``: a measured step's
    durations exactly as they ran (see :func:`replay`), instead of one cost per kind and stage."""

    times: Mapping[tuple, float]

    def duration(self, schedule: Schedule, rank: int, action: Action) -> float:
        key = (rank, action.kind, action.microbatch, action.chunk)
        try:
            return float(self.times[key]) + self.overhead
        except KeyError:
            raise ValueError(
                f"no measured time for rank {rank}'s {action} (key {key}): the timeline must hold every "
                f"compute action of the schedule, one row each, with ranks numbered as the schedule's "
                f"pipeline ranks") from None


def replay(timeline, schedule: Schedule, *, ranks: Optional[Sequence[int]] = None,
           p2p_latency: float = 0.0) -> "SimResult":
    """Re-run ``schedule`` with each compute action taking exactly the time it took in a measured
    ``timeline`` (rows rank, action, microbatch, chunk, start, end), every action starting as soon
    as its rank is free and its input has arrived (messages cost ``p2p_latency``; 0: free).

    ``ranks``: the global ranks of one pipeline, stage by stage (``topology.groups("pp")[0]``): the
    timeline's rows of other ranks are left out and these are numbered as pipeline ranks 0..p-1.
    ``None``: the timeline's ranks already are pipeline ranks. Raises ``ValueError`` unless the
    timeline holds each compute action of the schedule once, on each rank in the schedule's order.

    With free messages this is the fastest the measured actions could have run in this order: the
    measured run obeyed the same order and the same dependencies, plus the time its messages took
    and any wait for a processor, so its step is never shorter than the replay's (timestamps from one
    clock: ranks on one machine). The bubble of the replay is what the measured action times explain
    (unequal stages, actions slowed down while other ranks compute); the measured bubble beyond it
    is waiting for messages and for cores."""
    timeline = _pipeline_rows(timeline, schedule, ranks, "replay")
    steps = sorted(timeline["step"].unique()) if "step" in timeline.columns else []
    if len(steps) > 1:
        raise ValueError(f"replay: the timeline holds {len(steps)} steps ({steps[0]}..{steps[-1]}): pass one, "
                         f"e.g. events[events.step == {steps[-1]}]")
    times: dict[tuple, float] = {}
    for r, kind, mb, chunk, start, end in zip(timeline["rank"], timeline["action"], timeline["microbatch"],
                                             timeline["chunk"], timeline["start"], timeline["end"]):
        key = (int(r), str(kind), int(mb), int(chunk))
        if key in times:
            raise ValueError(f"replay: the timeline has two rows for {key} (rank, action, microbatch, chunk): "
                             f"pass one step of one pipeline (e.g. the first tp rank of each stage)")
        times[key] = float(end) - float(start)
    expected = sum(len(schedule.compute_actions(r)) for r in range(schedule.stages))
    if len(times) != expected:
        raise ValueError(f"replay: the timeline has {len(times)} compute actions, the schedule {expected}: "
                         f"pass one step of the pipeline that ran this schedule")
    # Each rank must have run its actions in the schedule's order: a timeline of another schedule,
    # or ranks given in the wrong order, would otherwise replay silently with the wrong times.
    ran = timeline.sort_values("start")
    for r in range(schedule.stages):
        mine = ran[ran["rank"] == r]
        got = [(str(k), int(mb), int(c)) for k, mb, c in zip(mine["action"], mine["microbatch"], mine["chunk"])]
        want = [(a.kind, a.microbatch, a.chunk) for a in schedule.compute_actions(r)]
        if got != want:
            i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise ValueError(
                f"replay: pipeline rank {r}'s compute action #{i} in the timeline is "
                f"{got[i] if i < len(got) else 'missing'}, the schedule's is {want[i] if i < len(want) else 'none'} "
                f"(kind, microbatch, chunk): pass the timeline of a step of this schedule, with ranks stage by stage")
    return simulate(schedule, ActionCosts(times=times, p2p_latency=p2p_latency))


def _durations(schedule: Schedule, costs: Costs):
    """``duration(rank, action)``: each kind of action's cost per rank and chunk, computed once
    (per action for :class:`ActionCosts`)."""
    if isinstance(costs, ActionCosts):
        return lambda r, a: costs.duration(schedule, r, a)
    cache: dict[tuple, float] = {}

    def duration(r: int, a: Action) -> float:
        key = (r, a.kind, a.chunk)
        d = cache.get(key)
        if d is None:
            d = cache[key] = costs.duration(schedule, r, a)
        return d

    return duration


def dry_run(schedule: Schedule, costs: Costs, *, ordered: bool = False, compute_only: bool = False) -> list[tuple]:
    """Run the schedule's actions on modelled time. Returns rows (rank, index, action, start, end).

    ``compute_only``: rows of compute actions only (what :func:`simulate` keeps; faster).

    Raises :class:`ScheduleError` on a deadlock (every unfinished rank waits for a message that is
    never sent), on a message that is sent but never received and, with ``ordered`` (no tags), on a
    receive that would get another message than it expects.
    """
    p = schedule.stages
    idx = [0] * p
    clock = [0.0] * p
    fifo: dict[tuple[int, int], deque] = {}           # ordered: per channel, messages in send order
    tagged: dict[tuple[int, int], dict] = {}          # tagged: per channel, messages by identity
    rows: list[tuple] = []
    hop = costs.message_time()
    # Per rank, each action once: (code, message key or duration, channel); 0 send, 1 receive, 2 compute.
    plans = []
    duration = _durations(schedule, costs)
    for r in range(p):
        plan = []
        for a in schedule.actions[r]:
            kind = a.kind
            if kind in ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"):
                key = schedule.message(r, a)      # (what, microbatch, sending virtual stage)
                if kind[0] == "S":
                    plan.append((0, key, (r, a.peer)))
                else:
                    plan.append((1, key, (a.peer, r)))
            else:
                plan.append((2, duration(r, a), None))
        plans.append(plan)
    # Event-driven: a rank runs until it must wait for a message; the send of that message wakes it.
    ready = deque(range(p))
    waiting: dict = {}                # (channel, key) or, ordered, channel -> the rank waiting for it
    while ready:
        r = ready.popleft()
        acts, plan = schedule.actions[r], plans[r]
        i, t, n = idx[r], clock[r], len(plan)
        while i < n:
            code, what, channel = plan[i]
            if code == 2:
                rows.append((r, i, acts[i], t, t + what))
                t += what
            elif code == 0:
                msg = (what, t + hop, i, acts[i])
                box = fifo.get(channel)
                if box is None:
                    box = fifo[channel] = deque()
                    tagged[channel] = {}
                box.append(msg)
                tagged[channel][what] = msg
                if not compute_only:
                    rows.append((r, i, acts[i], t, t))
                woken = waiting.pop(channel if ordered else (channel, what), None)
                if woken is not None:
                    ready.append(woken)
            else:
                if ordered:
                    box = fifo.get(channel)
                    if not box:
                        waiting[channel] = r
                        break  # blocked: nothing has arrived from the peer yet
                    key, arrival, s_idx, s_act = box[0]
                    if key != what:
                        a = acts[i]
                        raise ScheduleError(
                            f"would receive {s_act} (rank {a.peer}'s action #{s_idx}) instead of the message it "
                            f"expects: without tags, messages between rank {a.peer} and rank {r} must be received "
                            f"in the order they are sent", rank=r, index=i, action=a)
                    box.popleft()
                    del tagged[channel][key]
                else:
                    inbox = tagged.get(channel)
                    msg = inbox.pop(what, None) if inbox is not None else None
                    if msg is None:
                        waiting[(channel, what)] = r
                        break  # blocked: this message has not been sent yet
                    key, arrival, s_idx, s_act = msg
                    box = fifo[channel]
                    if box[0] is msg:
                        box.popleft()
                    else:
                        box.remove(msg)
                start = t
                if arrival > t:
                    t = arrival
                if not compute_only:
                    rows.append((r, i, acts[i], start, t))
            i += 1
        idx[r], clock[r] = i, t
    stuck = [r for r in range(p) if idx[r] < len(schedule.actions[r])]
    if stuck:
        waits = "; ".join(
            f"rank {r} waits at action #{idx[r]} {schedule.actions[r][idx[r]]}" for r in stuck)
        r0 = stuck[0]
        raise ScheduleError(f"deadlock: {waits}; no rank can make progress",
                            rank=r0, index=idx[r0], action=schedule.actions[r0][idx[r0]])
    for (src, dst), box in sorted(fifo.items()):
        if box:
            _, _, s_idx, s_act = box[0]
            raise ScheduleError(f"is never received: rank {dst} has no matching receive", rank=src,
                                index=s_idx, action=s_act)
    return rows


def _tagged_compute_run(schedule: Schedule, costs: Costs) -> tuple[dict, list, float]:
    """:func:`dry_run` with tags and ``compute_only``, for :func:`simulate`: the same semantics,
    with each message named by one integer (its identity: sending virtual stage, microbatch,
    activation or gradient) in one table, and the timeline built as columns. Returns (columns,
    busy time per rank, step time); raises :class:`ScheduleError` like :func:`dry_run`."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    hop = costs.message_time()
    # ActionCosts (or any Costs with a duration of its own) may give each microbatch its own time
    per_action = type(costs).duration is not Costs.duration
    # Per rank, kind -> (code, one value per chunk), read once per action in the loop below:
    # code 0 sends and 1 receives the message named value + 2 * microbatch, code 2 computes for
    # the value's time, code 3 for the action's own time.
    tables = []
    for r in range(p):
        vs = [schedule.virtual_stage(r, c) for c in range(v)]
        table = {"SEND_ACT": (0, [2 * m * vs[c] for c in range(v)]),
                 "SEND_GRAD": (0, [2 * m * vs[c] + 1 for c in range(v)]),
                 "RECV_ACT": (1, [2 * m * (vs[c] - 1) for c in range(v)]),
                 "RECV_GRAD": (1, [2 * m * (vs[c] + 1) + 1 for c in range(v)])}
        for kind in COMPUTE:
            table[kind] = (3, None) if per_action else (
                2, [costs.duration(schedule, r, Action(kind, 0, c)) for c in range(v)])
        tables.append(table)
    ranks, kinds, mbs, chunks, starts, ends = [], [], [], [], [], []
    add_rank, add_kind, add_mb, add_chunk = ranks.append, kinds.append, mbs.append, chunks.append
    add_start, add_end = starts.append, ends.append
    busy = [0.0] * p
    idx, clock = [0] * p, [0.0] * p
    sent: dict[int, float] = {}
    waiting: dict[int, int] = {}
    ready = deque(range(p))
    while ready:
        r = ready.popleft()
        acts, table = schedule.actions[r], tables[r]
        i, t, n = idx[r], clock[r], len(acts)
        work = 0.0
        while i < n:
            kind, mb, c, _ = acts[i]
            code, values = table[kind]
            if code >= 2:
                x = values[c] if code == 2 else costs.duration(schedule, r, acts[i])
                add_rank(r)
                add_kind(kind)
                add_mb(mb)
                add_chunk(c)
                add_start(t)
                t += x
                add_end(t)
                work += x
            elif code == 0:
                x = values[c] + 2 * mb
                sent[x] = t + hop
                woken = waiting.pop(x, None)
                if woken is not None:
                    ready.append(woken)
            else:
                x = values[c] + 2 * mb
                arrival = sent.pop(x, None)
                if arrival is None:
                    waiting[x] = r
                    break         # blocked: this message has not been sent yet
                if arrival > t:
                    t = arrival
            i += 1
        idx[r], clock[r] = i, t
        busy[r] += work
    if any(idx[r] < len(schedule.actions[r]) for r in range(p)) or sent:
        dry_run(schedule, costs)          # the reference engine names the deadlock or the lost message
        raise ScheduleError("the schedule does not run to its end")   # not reached: dry_run raised
    cols = {"rank": ranks, "action": kinds, "microbatch": mbs, "chunk": chunks, "start": starts, "end": ends}
    return cols, busy, max(ends, default=0.0)


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        timeline: DataFrame of compute actions (rank, action, microbatch, chunk, start, end).
        step_time: end of the last action on any rank.
        bubble_fraction: idle share of ``p * step_time`` over all ranks.
        bubble_per_rank: idle share of ``step_time`` per rank (dict rank -> float).
        bubble_ratio: total idle time over total busy time (the "of the ideal time" form of
            Narayanan et al. 2021: ``(p-1)/(v m)`` for interleaved 1F1B).
        peak_inflight: per rank, the most (microbatch, chunk) pairs whose activations are held at
            once (from the forward until its last backward action: B, or W after I).
        busy_per_rank: compute time per rank.
    """

    schedule: Schedule
    timeline: object
    step_time: float
    bubble_fraction: float
    bubble_per_rank: dict
    bubble_ratio: float
    peak_inflight: dict
    busy_per_rank: dict

    def summary(self):
        """One row per rank: busy, idle, bubble share and peak in-flight microbatches."""
        import pandas as pd

        rows = [{"rank": r, "busy": self.busy_per_rank[r], "idle": self.step_time - self.busy_per_rank[r],
                 "bubble": self.bubble_per_rank[r], "peak_inflight": self.peak_inflight[r]}
                for r in range(self.schedule.stages)]
        return pd.DataFrame(rows).set_index("rank")

    def __repr__(self) -> str:
        s = self.schedule
        return (f"SimResult({s.name}, p={s.stages}, m={s.microbatches}, v={s.chunks}: step_time={self.step_time:.4g}, "
                f"bubble={self.bubble_fraction:.1%}, peak_inflight={list(self.peak_inflight.values())})")

    def _repr_html_(self) -> str:
        return f"<b>{self!r}</b>" + self.summary()._repr_html_()


def inflight_peaks(schedule: Schedule) -> dict[int, int]:
    """Peak number of (microbatch, chunk) pairs held per rank, from action order alone (held from
    the forward until the last backward action: B, or W of a split backward)."""
    peaks = {}
    for r in range(schedule.stages):
        held = peak = 0
        for a in schedule.actions[r]:
            kind = a[0]                       # a.kind, read as the tuple it is (a third of the time)
            if kind == "F":
                held += 1
                if held > peak:
                    peak = held
            elif kind == "B" or kind == "W":
                held -= 1
        peaks[r] = peak
    return peaks


def shared_run(schedule: Schedule, costs: Costs, *, cores: float) -> list[tuple]:
    """Like :func:`dry_run`, for ranks that share ``cores`` processors (a laptop running more ranks
    than it has cores): at any moment the ranks that are computing share the cores equally (each at
    speed ``min(1, cores / computing ranks)``; processor sharing), while waiting ranks use none.
    Costs are each action's time when it runs alone. Messages are matched by identity (tags)."""
    p = schedule.stages
    idx = [0] * p
    remaining = [None] * p            # work left in the current compute action
    started = [0.0] * p
    sent: dict[tuple, float] = {}     # message identity -> arrival time
    rows: list[tuple] = []
    t = 0.0
    hop = costs.message_time()
    while True:
        progress = True
        while progress:               # take every action that needs no time now
            progress = False
            for r in range(p):
                acts = schedule.actions[r]
                while remaining[r] is None and idx[r] < len(acts):
                    a = acts[idx[r]]
                    if a.kind.startswith("SEND"):
                        sent[(a.peer, schedule.message(r, a))] = t + hop
                        rows.append((r, idx[r], a, t, t))
                    elif a.kind.startswith("RECV"):
                        key = (r, schedule.message(r, a))
                        arrival = sent.get(key)
                        if arrival is None or arrival > t:
                            break
                        del sent[key]
                        rows.append((r, idx[r], a, t, t))
                    else:
                        remaining[r], started[r] = costs.duration(schedule, r, a), t
                        if remaining[r] <= 0:
                            rows.append((r, idx[r], a, t, t))
                            remaining[r] = None
                        else:
                            break
                    idx[r] += 1
                    progress = True
        busy = [r for r in range(p) if remaining[r] is not None]
        waiting_arrivals = [v for v in sent.values() if v > t]
        if not busy and not waiting_arrivals:
            break
        speed = min(1.0, cores / len(busy)) if busy else 0.0
        dt = min([remaining[r] / speed for r in busy] + [v - t for v in waiting_arrivals])
        t += dt
        for r in busy:
            remaining[r] -= dt * speed
            if remaining[r] <= 1e-12:
                a = schedule.actions[r][idx[r]]
                rows.append((r, idx[r], a, started[r], t))
                remaining[r] = None
                idx[r] += 1
    stuck = [r for r in range(p) if idx[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {r} waits at action #{idx[r]} {schedule.actions[r][idx[r]]}"
                                                     for r in stuck), rank=stuck[0])
    return rows


def simulate(schedule: Schedule, costs: Union[Costs, Mapping[str, object]], *,
             cores: Optional[float] = None) -> SimResult:
    """Simulate ``schedule`` with ``costs`` (a :class:`Costs` or a mapping such as
    ``{"forward": 1.0, "backward": 2.0}``; missing kinds cost nothing).

    ``cores``: the ranks share this many processors (:func:`shared_run`); ``None``: each rank has
    its own (one GPU per rank)."""
    import numpy as np
    import pandas as pd

    from mlmkit.pipeline.validate import validate

    if not getattr(schedule, "_validated", False):
        # Generated schedules are checked by the test suite, generator by generator; a custom one is
        # checked here once (a schedule is immutable). The run below still catches any deadlock.
        validate(schedule)
        object.__setattr__(schedule, "_validated", True)
    costs = Costs.from_mapping(costs)
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, numbers.Real) or not cores > 0
                              or cores == float("inf")):
        raise ValueError(f"simulate: cores={cores!r} must be a finite number > 0 (or None: one processor per rank)")
    shared = cores is not None and cores < schedule.stages
    if shared:
        rows = shared_run(schedule, costs, cores=cores)
        step = max((end for *_, end in rows), default=0.0)
        rows = [row for row in rows if row[2].kind in ("F", "B", "I", "W")]
        cols = {"rank": [row[0] for row in rows], "action": [row[2].kind for row in rows],
                "microbatch": [row[2].microbatch for row in rows], "chunk": [row[2].chunk for row in rows],
                "start": [row[3] for row in rows], "end": [row[4] for row in rows]}
        busy = {r: 0.0 for r in range(schedule.stages)}
        for row in rows:
            busy[row[0]] += row[4] - row[3]
    else:
        cols, per_rank_busy, step = _tagged_compute_run(schedule, costs)
        busy = dict(enumerate(per_rank_busy))
    n = len(cols["rank"])
    # numeric columns through numpy (a quarter of the time pandas takes to infer them from lists)
    timeline = pd.DataFrame({k: (np.fromiter(v, dtype=np.float64 if k in ("start", "end") else np.int64, count=n)
                                 if k != "action" and n else v) for k, v in cols.items()})
    total_busy = sum(busy.values())
    per_rank = {r: (1.0 - busy[r] / step) if step else 0.0 for r in busy}
    fraction = (1.0 - total_busy / (schedule.stages * step)) if step else 0.0
    ratio = (schedule.stages * step - total_busy) / total_busy if total_busy else 0.0
    return SimResult(schedule=schedule, timeline=timeline, step_time=step, bubble_fraction=fraction,
                     bubble_per_rank=per_rank, bubble_ratio=ratio, peak_inflight=inflight_peaks(schedule),
                     busy_per_rank=busy)
