"""Pipeline schedules as data: for each rank, the ordered list of actions it performs in one step.

Pure planning code (no torch). The same :class:`Schedule` object is validated
(:mod:`~mlmkit.pipeline.validate`), simulated (:mod:`~mlmkit.pipeline.simulate`), drawn
(:mod:`mlmkit.viz`) and executed on real ranks (:mod:`~mlmkit.pipeline.executor`).

Vocabulary:
- ``p`` = ``stages``: pipeline ranks; ``m`` = ``microbatches``; ``v`` = ``chunks``: model chunks per
  rank. The *placement* says which rank holds which of the ``p * v`` virtual stages:

  - ``"loop"`` (Megatron-LM's interleaving): chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``;
    activations flow ``r -> r+1`` and wrap from the last rank back to rank 0 at chunk boundaries;
  - ``"v"`` (the V-shaped zero-bubble schedules, 2 chunks): chunk 0 of rank ``r`` is stage ``r``,
    chunk 1 is stage ``2p-1-r``; activations go down the ranks and come back up, the last rank
    hands its chunk 0's output to its own chunk 1 (no message), and rank 0 holds both the first
    and the last stage.
- Compute actions, PyTorch's vocabulary (``torch.distributed.pipelining``): ``F`` (forward),
  ``B`` (full backward: input and weight gradients), ``I`` (backward for the input gradient only)
  and ``W`` (backward for the weight gradients, after its ``I``). Zero-bubble schedules split
  backward into I and W; DualPipeV mixes B with I/W.
- Communication actions: ``SEND_ACT``/``RECV_ACT`` (activations, forward direction) and
  ``SEND_GRAD``/``RECV_GRAD`` (gradients, backward direction), each naming its peer rank.

Generators (:func:`make_schedule`): ``"gpipe"`` (Huang et al. 2019), ``"1f1b"`` (PipeDream-Flush,
Narayanan et al. 2021a), ``"interleaved-1f1b"`` (Narayanan et al. 2021b, Megatron-LM's order),
``"zb-h1"`` (zero bubble, Qi et al. 2023), ``"zb-v"`` (the V-shaped zero-bubble schedule, Qi et al.
2024, as PyTorch's ScheduleZBVZeroBubble) and ``"dualpipev"`` (DeepSeek-AI 2024's DualPipe in its
V form, as PyTorch's ScheduleDualPipeV; its overlapped forward-backward pairs run one after the
other here).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence

from mlmkit.scalars import plain_bool

__all__ = [
    "COMPUTE", "COMM", "KINDS", "PLACEMENTS", "Action", "Schedule", "ScheduleError", "SCHEDULES", "V_SCHEDULES",
    "MAX_MICROBATCHES", "MAX_SCHEDULE_SIZE", "make_schedule", "schedule_from_table", "stage_rank",
]

#: Most microbatches :func:`make_schedule` builds a schedule for: it lists every action (about
#: 0.3-0.5 GB and 2-4 s at this count with 4 stages), so a batch with a few zeros too many is an
#: error here, not a machine out of memory (a trainer, an estimate or a simulation).
MAX_MICROBATCHES = 2**16
#: Most ``stages x microbatches x chunks`` :func:`make_schedule` builds (0.6-0.9 GB and 5-7 s at this
#: count, measured for 1f1b, zb-v and dualpipev), so ``stages=10**9`` is an error here, not half a
#: minute of building before a MemoryError.
MAX_SCHEDULE_SIZE = 2**20

COMPUTE = ("F", "B", "I", "W")
#: Placements of virtual stages on ranks.
PLACEMENTS = ("loop", "v")
COMM = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
KINDS = COMPUTE + COMM


class ScheduleError(ValueError):
    """A schedule that must not run. ``rank`` and ``index`` locate the offending action, if any."""

    def __init__(self, message: str, *, rank: Optional[int] = None, index: Optional[int] = None,
                 action: Optional["Action"] = None):
        self.rank, self.index, self.action = rank, index, action
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f", action #{index}"
            if action is not None:
                where += f" {action}"
            where += ": "
        super().__init__(where + message)


class Action(NamedTuple):
    """One step of one rank. ``peer`` is the other rank for communication actions, else ``None``."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: Optional[int] = None

    def __str__(self) -> str:
        s = f"{self.kind}(mb={self.microbatch}"
        if self.chunk:
            s += f", chunk={self.chunk}"
        if self.peer is not None:
            s += f", {'to' if self.kind.startswith('SEND') else 'from'} rank {self.peer}"
        return s + ")"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one training step.

    Attributes:
        name: generator name, or ``"custom"``.
        stages: ``p``, number of pipeline ranks. microbatches: ``m``. chunks: ``v``.
        actions: ``actions[r]`` is rank r's ordered tuple of :class:`Action`.
        placement: ``"loop"`` or ``"v"`` (module docstring).
        notes: remarks of the generator worth showing a user (e.g. a large bubble).
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    placement: str = "loop"
    notes: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        # Checked here, not only in validate(): a Schedule built by hand with chunks=None or
        # placement=None was drawn and simulated as a loop, and microbatches="4" failed as
        # "'<' not supported" deep in validate.
        if not isinstance(self.name, str):
            raise ScheduleError(f"name={self.name!r} must be a string (a generator's name, or 'custom')")
        for key in ("stages", "microbatches", "chunks"):
            _check_int(key, getattr(self, key))
            object.__setattr__(self, key, int(getattr(self, key)))   # numpy integers: Python ints
        if not isinstance(self.placement, str) or self.placement not in PLACEMENTS:
            raise ScheduleError(f"placement={self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if not isinstance(self.actions, (tuple, list)) or not all(
                isinstance(acts, (tuple, list)) and all(isinstance(a, Action) for a in acts) for acts in self.actions):
            raise ScheduleError("actions must hold one sequence of mlmkit.pipeline.Action per rank; build them with "
                                "Action(kind, microbatch, chunk, peer), or the schedule with schedule_from_table")

    @property
    def split_backward(self) -> bool:
        """Some backward is split into I (input gradient) and W (weight gradients)."""
        return any(a.kind in ("I", "W") for acts in self.actions for a in acts)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        if self.placement == "v":
            return rank if chunk == 0 else 2 * self.stages - 1 - rank
        return chunk * self.stages + rank

    def message(self, rank: int, action: Action) -> tuple[str, int, int]:
        """The message a SEND or RECV action of ``rank`` carries: ``(what, microbatch, sending
        virtual stage)``, ``what`` being ``"act"`` or ``"grad"``; a send and the receive it feeds
        name the same message."""
        vs = self.virtual_stage(rank, action.chunk)
        if action.kind == "SEND_ACT":
            return ("act", action.microbatch, vs)
        if action.kind == "RECV_ACT":
            return ("act", action.microbatch, vs - 1)
        if action.kind == "SEND_GRAD":
            return ("grad", action.microbatch, vs)
        if action.kind == "RECV_GRAD":
            return ("grad", action.microbatch, vs + 1)
        raise ValueError(f"{action} carries no message")

    def rank_of(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding a virtual stage."""
        return stage_rank(virtual_stage, stages=self.stages, placement=self.placement)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def to_frame(self):
        """One row per action: rank, index (position on its rank), kind, microbatch, chunk, peer."""
        import pandas as pd

        rows = [
            {"rank": r, "index": i, "kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk,
             "peer": a.peer}
            for r, acts in enumerate(self.actions) for i, a in enumerate(acts)
        ]
        df = pd.DataFrame(rows, columns=["rank", "index", "kind", "microbatch", "chunk", "peer"])
        df["peer"] = df["peer"].astype("Int64")
        return df

    def compact(self) -> str:
        """Compute actions per rank as text, e.g. ``rank 0: F0 F1 B0 F2 B1 B2``."""
        lines = []
        for r in range(self.stages):
            cells = []
            for a in self.compute_actions(r):
                cells.append(f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if self.chunks > 1 else ""))
            lines.append(f"rank {r}: " + " ".join(cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return f"{self!r}\n{self.compact()}{notes}"

    def _repr_html_(self) -> str:
        import html

        body = self.compact().replace("\n", "<br>")
        notes = "".join(f"<br><i>note: {html.escape(n)}</i>" for n in self.notes)
        return f"<b>{html.escape(repr(self))}</b><br><code>{body}</code>{notes}"


def stage_rank(virtual_stage: int, *, stages: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, chunk) holding ``virtual_stage`` among ``stages`` ranks with ``placement``."""
    p = stages
    if placement == "v":
        return (virtual_stage, 0) if virtual_stage < p else (2 * p - 1 - virtual_stage, 1)
    return virtual_stage % p, virtual_stage // p


# ----------------------------------------------------------------------------------- generators
def _gpipe(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p)]


def _one_f_one_b(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [("F", i, 0) for i in range(warmup)]                       # warm-up
        for i in range(m - warmup):                                         # steady state
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]                # cool-down
        out.append(order)
    return out


def _interleaved(p: int, m: int, v: int, group: int) -> list[list[tuple[str, int, int]]]:
    # Megatron-LM's order: microbatches are taken in groups of `group` (its
    # microbatch_group_size_per_vp_stage, default p); within a group every chunk runs all of the
    # group's microbatches, chunk after chunk (the last group takes what remains). The k-th forward
    # of a rank runs table[k]; backwards read the same table with the chunks reversed. Warm-up:
    # 2 (p - r - 1) + (v - 1) group forwards. With group = p and m divisible by p this is the
    # classic (k // p) % v chunk order of Narayanan et al. 2021.
    table = []
    for start in range(0, m, group):
        stop = m if start + group >= m else start + group
        table += [(mb, c) for c in range(v) for mb in range(start, stop)]
    total = m * v

    def fwd(k):
        return ("F", table[k][0], table[k][1])

    def bwd(k):
        return ("B", table[k][0], v - 1 - table[k][1])

    out = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * group, total)
        order = [fwd(k) for k in range(warmup)]                            # warm-up
        for k in range(total - warmup):                                   # steady state
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]            # cool-down
        out.append(order)
    return out


def _zb_h1(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    # ZB-H1 (Qi et al. 2023): backward is split into B (input gradient, on the critical path back
    # to rank 0) and W (weight gradient, which nothing waits for). Each rank is replayed greedily in
    # unit time (F = B = W = 1, free communication), always picking by priority:
    #   1. B, as soon as its gradient has arrived (keeps the backward wave moving);
    #   2. W, if more than p - 1 of them are pending (bounds the memory W's hold);
    #   3. F, if its input has arrived and fewer than p - r microbatches sit between F and B
    #      (1F1B's activation limit on rank r);
    #   4. any pending W, to fill what would otherwise be bubble.
    # A W takes the most recent pending microbatch (last in, first out): its X and dY were written by
    # the I just before it and are still in the CPU's cache, where the oldest one's (torch's choice)
    # must be read back from memory. Nothing else changes: the same slots, the same number of W
    # pending at every moment (so the same memory peak), the gradient sums in another order.
    # Measured on the pipeline benchmark's stages, paired with the oldest-first order in the same
    # processes (4 ranks on 2 cores): about 2% less step time at pp=2 and at pp=4.
    # The bubble falls from 1F1B's (p-1)(F+B+W) to (p-1)(F+B-W): a third of it when F = B = W.
    w_cap = p - 1
    free = [0] * p                            # time at which each rank is next idle
    next_f, next_b = [0] * p, [0] * p         # next microbatch to forward / backward, per rank
    f_arrival = [dict() for _ in range(p)]    # microbatch -> time its input is available
    b_arrival = [dict() for _ in range(p)]    # microbatch -> time its output gradient is available
    for mb in range(m):
        f_arrival[0][mb] = 0
    between_f_and_b, pending_w = [0] * p, [[] for _ in range(p)]
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    while any(len(o) < 3 * m for o in orders):
        r = min((x for x in range(p) if len(orders[x]) < 3 * m), key=lambda x: (free[x], x))
        now = free[r]
        b_time = b_arrival[r].get(next_b[r])
        f_time = f_arrival[r].get(next_f[r]) if between_f_and_b[r] < p - r else None
        if b_time is not None and b_time <= now:
            mb = next_b[r]
            orders[r].append(("I", mb, 0))
            next_b[r] += 1
            between_f_and_b[r] -= 1
            pending_w[r].append(mb)
            if r > 0:
                b_arrival[r - 1][mb] = now + 1
        elif pending_w[r] and (len(pending_w[r]) > w_cap or f_time is None or f_time > now):
            orders[r].append(("W", pending_w[r].pop(), 0))
        elif f_time is not None and f_time <= now:
            mb = next_f[r]
            orders[r].append(("F", mb, 0))
            next_f[r] += 1
            between_f_and_b[r] += 1
            if r < p - 1:
                f_arrival[r + 1][mb] = now + 1
            else:
                b_arrival[r][mb] = now + 1    # the last stage's loss is its own gradient source
        else:                                 # idle until something arrives for this rank
            waits = [t for t in (b_time, f_time) if t is not None and t > now]
            busy_others = [free[x] for x in range(p) if x != r and free[x] > now]
            free[r] = min(waits or busy_others or [now + 1])
            continue
        free[r] = now + 1
    return orders


def _zb_v(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    # ZB-V (Qi et al. 2024, section 6; the order of PyTorch's ScheduleZBVZeroBubble): 2 chunks per
    # rank in a V. Warm-up: forwards of chunk 0, then chunk 0 and chunk 1 alternately, then chunk 1's
    # first backwards (I, W) right after its forwards; steady state: F I W on chunk 0, then on chunk
    # 1; cool-down: the remaining I's, W's filling what would be bubble. The order is computed for at
    # least 2p - 1 microbatches (the pipeline must fill), then microbatches beyond m are dropped.
    n = max(2 * p - 1, m)
    out = []
    for r in range(p):
        order: list[tuple[str, int, int]] = []
        f = [0, 0]
        b = [0, 0]

        def add(kind, c):
            counter = f if kind == "F" else b
            order.append((kind, counter[c], c))
            if kind != "W":
                counter[c] += 1

        for _ in range(2 * (p - r) - 1):                      # warm-up 1: chunk 0 forwards
            add("F", 0)
        for _ in range(r):                                    # warm-up 2: chunk 1 and chunk 0
            add("F", 1)
            add("F", 0)
        for _ in range(p - r):                                # warm-up 3: chunk 1 F I W
            add("F", 1)
            order.append(("I", b[1], 1))
            order.append(("W", b[1], 1))
            b[1] += 1
        while f[1] < f[0] or f[0] < n:                        # steady state
            if f[0] < n:
                add("F", 0)
            order.append(("I", b[0], 0))
            order.append(("W", b[0], 0))
            b[0] += 1
            add("F", 1)
            order.append(("I", b[1], 1))
            order.append(("W", b[1], 1))
            b[1] += 1
        w = [b[0], b[1]]                                      # cool-down
        for _ in range(r):
            order.append(("I", b[0], 0))
            b[0] += 1
            order.append(("I", b[1], 1))
            b[1] += 1
        for _ in range(p - r):
            order.append(("I", b[0], 0))
            b[0] += 1
            order.append(("W", w[0], 0))
            w[0] += 1
        order += [("W", k, 1) for k in range(w[1], b[1])]
        order += [("W", k, 0) for k in range(w[0], b[0])]
        out.append([a for a in order if a[1] < m])
    return out


def _dualpipe_v(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    # DualPipeV (DeepSeek-AI 2024, DualPipe's V form; the order of PyTorch's ScheduleDualPipeV).
    # In the steady state DualPipe overlaps the forward of one chunk with the backward of the other
    # (F0 with B1, F1 with B0); mlmkit runs each pair one after the other. The first backwards of
    # chunk 1 and the last ones are split into I and W to fill bubbles.
    out = []
    for r in range(p):
        order: list[tuple[str, int, int]] = []
        count: dict[tuple[str, int], int] = {}
        pending_w: list[tuple[int, int]] = []

        def add(kind, c):
            key = (kind if kind != "B" else "I", c)
            mb = count.get(key, 0)
            order.append((kind, mb, c))
            count[key] = mb + 1
            if kind == "I":
                pending_w.append((mb, c))

        def add_w():
            if pending_w:
                mb, c = pending_w.pop(0)
                order.append(("W", mb, c))

        for _ in range(2 * (p - r - 1)):                      # 1: F0
            add("F", 0)
        for _ in range(r + 1):                                # 2: F0 F1
            add("F", 0)
            add("F", 1)
        for _ in range(p - r - 1):                            # 3: I1 W F1 (zero bubble)
            add("I", 1)
            add_w()
            add("F", 1)
        for i in range(m - 2 * p + r + 1):                    # 4: (F0, B1) (F1, B0)
            add("F", 0)
            add("B", 1)
            add("F", 1)
            add("B", 0)
        for _ in range(p - r - 1):                            # 5: B1 (F1, B0)
            add("B", 1)
            add("F", 1)
            add("B", 0)
        zb = False
        for i in range(r + 1):                                # 6: B1 B0, split from the middle on
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            add("I" if zb else "B", 1)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            add("I" if zb else "B", 0)
        for _ in range(p - r - 1):                            # 7: W B0
            add_w()
            add("I" if zb else "B", 0)
        for _ in range(r + 1):                                # 8: W
            add_w()
        while pending_w:
            add_w()
        out.append(order)
    return out


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev")
#: Schedules whose two chunks per rank sit in a V (``placement="v"``).
V_SCHEDULES = ("zb-v", "dualpipev")


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ScheduleError(f"{name}={value!r} must be an integer >= {minimum}")


def make_schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1,
                  layers: Optional[int] = None, microbatch_group: Optional[int] = None) -> Schedule:
    """Generate a named schedule (one of :data:`SCHEDULES`) for ``stages`` pipeline ranks.

    Args:
        name: one of :data:`SCHEDULES`.
        stages: pipeline ranks ``p``. microbatches: ``m``. chunks: model chunks per rank ``v``
            (interleaved-1f1b takes ``v >= 2``; zb-v and dualpipev exactly 2, in a V).
        layers: if given, checked to divide into ``p * v`` stages of at least one layer.
        microbatch_group: interleaved-1f1b only: microbatches per group (Megatron-LM's
            ``microbatch_group_size_per_vp_stage``; default ``p``). Megatron's rule: ``p <= group
            <= m``, and the last group's remainder ``m % group`` is 0 or at least ``p``. With the
            default this asks ``m`` divisible by ``p``; a larger group allows other ``m``.

    Raises:
        ScheduleError: with the offending value and the rule it breaks.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    _check_int("stages", stages)
    _check_int("microbatches", microbatches)
    _check_int("chunks", chunks)
    if microbatches > MAX_MICROBATCHES:
        raise ScheduleError(f"microbatches={microbatches}: a schedule is built action by action (about 2.5 kB per "
                            f"microbatch and stage), so at most {MAX_MICROBATCHES} microbatches are planned; use "
                            f"fewer, larger microbatches")
    p, m, v = int(stages), int(microbatches), int(chunks)        # numpy integers: Python ints in the schedule
    if p * m * v > MAX_SCHEDULE_SIZE:
        raise ScheduleError(f"stages={p} x microbatches={m} x chunks={v} = {p * m * v}: a schedule lists every "
                            f"action (up to 0.9 kB per stage, microbatch and chunk), so at most {MAX_SCHEDULE_SIZE} "
                            f"are planned; use fewer stages or fewer, larger microbatches")
    if name in V_SCHEDULES:
        if v != 2:
            raise ScheduleError(f"{name!r} runs exactly 2 model chunks per rank, in a V (chunks=2), not chunks={v}")
    elif name != "interleaved-1f1b" and v != 1:
        raise ScheduleError(f"chunks={v}: only 'interleaved-1f1b', 'zb-v' and 'dualpipev' run more than one "
                            f"model chunk per rank")
    if name == "dualpipev" and m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least as many microbatches as virtual stages (2 x stages = {2 * p}), "
                            f"got microbatches={m}; use {2 * p} or more")
    notes: tuple[str, ...] = ()
    if name in ("1f1b", "zb-h1") and m < p:
        # Megatron-LM runs 1F1B with fewer microbatches than stages (every microbatch is in warm-up).
        notes = (f"microbatches={m} < stages={p}: the pipeline never fills, so the bubble is large "
                 f"((p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.0%} of the step with equal costs); use at least "
                 f"{p} microbatches to keep it small.",)
    if name == "interleaved-1f1b" and m < p:
        raise ScheduleError(
            f"too few microbatches for {name!r}: microbatches={m} < stages={p}; the pipeline never fills. "
            f"Use at least {p} microbatches (or 'gpipe'/'1f1b')."
        )
    if microbatch_group is not None and name != "interleaved-1f1b":
        raise ScheduleError(f"microbatch_group={microbatch_group!r} applies to 'interleaved-1f1b' only")
    group = p if microbatch_group is None else microbatch_group
    if name == "interleaved-1f1b":
        if v < 2:
            raise ScheduleError("interleaved-1f1b needs chunks >= 2 (with chunks=1 it is plain '1f1b')")
        _check_int("microbatch_group", group)
        if not p <= group <= m:
            raise ScheduleError(
                f"interleaved-1f1b: the microbatch group (contiguous microbatches per virtual stage, Megatron-LM's "
                f"microbatch_group_size_per_vp_stage) must lie in [stages={p}, microbatches={m}], got {group}")
        rest = m % group
        if 0 < rest < p:
            valid = [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]
            raise ScheduleError(
                f"interleaved-1f1b: microbatches={m} leave a last group of {rest} (microbatch_group={group}) "
                f"with fewer microbatches than stages={p}; Megatron-LM refuses it: it introduces dependency "
                f"bubbles in the pipeline and reduces throughput. Use microbatches divisible by the group"
                + (f", or microbatch_group={valid[0]}" if valid else f", or microbatches={-(-m // p) * p}"))
    if layers is not None:
        _check_int("layers", layers)
        if p * v > layers:
            raise ScheduleError(f"{p * v} stages (stages={p} x chunks={v}) but only layers={layers}")
        if layers % (p * v) and name == "interleaved-1f1b":
            raise ScheduleError(
                f"chunks={v} does not divide the layers: layers={layers} is not divisible by "
                f"stages x chunks = {p * v}"
            )
    orders = {
        "gpipe": lambda: _gpipe(p, m),
        "1f1b": lambda: _one_f_one_b(p, m),
        "interleaved-1f1b": lambda: _interleaved(p, m, v, group),
        "zb-h1": lambda: _zb_h1(p, m),
        "zb-v": lambda: _zb_v(p, m),
        "dualpipev": lambda: _dualpipe_v(p, m),
    }[name]()
    return _with_communication(name, p, m, v, orders=orders, notes=notes,
                               placement="v" if name in V_SCHEDULES else "loop")


def _with_communication(name: str, p: int, m: int, v: int, *, orders: Sequence[Iterable[tuple[str, int, int]]],
                        notes: tuple[str, ...] = (), placement: str = "loop") -> Schedule:
    """Insert sends and receives around compute actions: receive just before use, send just after.
    A neighbouring stage on the same rank (the tip of a V) is handed over without a message."""
    shell = Schedule(name=name, stages=p, microbatches=m, chunks=v, actions=(), placement=placement)
    last = p * v - 1
    actions = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for kind, mb, c in order:
            s = shell.virtual_stage(r, c)
            prev_rank = shell.rank_of(s - 1)[0] if s > 0 else None
            next_rank = shell.rank_of(s + 1)[0] if s < last else None
            if kind == "F":
                if prev_rank is not None and prev_rank != r:
                    acts.append(Action("RECV_ACT", mb, c, prev_rank))
                acts.append(Action("F", mb, c))
                if next_rank is not None and next_rank != r:
                    acts.append(Action("SEND_ACT", mb, c, next_rank))
            elif kind in ("B", "I"):
                if next_rank is not None and next_rank != r:
                    acts.append(Action("RECV_GRAD", mb, c, next_rank))
                acts.append(Action(kind, mb, c))
                if prev_rank is not None and prev_rank != r:
                    acts.append(Action("SEND_GRAD", mb, c, prev_rank))
            else:
                acts.append(Action(kind, mb, c))
        actions.append(tuple(acts))
    out = Schedule(name=name, stages=p, microbatches=m, chunks=v, actions=tuple(actions), notes=notes,
                   placement=placement)
    object.__setattr__(out, "_validated", True)   # generated: every generator is validated by the tests
    return out


_BLANK = object()


def _table_int(row: dict, key: str, i: int, default=_BLANK):
    """Cell ``key`` of table row ``i`` as an int; a missing or blank (None, NaN) cell is ``default``
    (refused when there is none)."""
    value = row.get(key)
    if value is None or (isinstance(value, numbers.Real) and value != value):
        if default is _BLANK:
            raise ScheduleError(f"row {i}: {key} is blank; every row needs a whole-number {key}")
        return default
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or abs(value) == float("inf")
            or value != int(value)):
        raise ScheduleError(f"row {i}: {key}={value!r} is not a whole number")
    return int(value)


def schedule_from_table(table, *, stages: Optional[int] = None, microbatches: Optional[int] = None,
                        chunks: Optional[int] = None, name: str = "custom",
                        add_communication: bool = False, placement: str = "loop") -> Schedule:
    """Build a hand-written schedule from a table (DataFrame or list of dicts / tuples).

    Rows need ``rank``, ``kind``, ``microbatch`` and optionally ``chunk`` and ``peer``, in execution
    order per rank; a tuple row is ``(rank, kind, microbatch)`` or ``(rank, kind, microbatch, chunk,
    peer)`` (a 4-tuple is refused: it is ambiguous). With ``add_communication=True`` the table lists compute actions only and sends
    and receives are inserted as the generators do. The result is not validated here: pass it to
    :func:`mlmkit.pipeline.validate` (the executor does so before running anything).
    """
    for key, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if value is not None:
            _check_int(key, value)
    if not isinstance(name, str):
        raise ScheduleError(f"name={name!r} must be a string")
    if not isinstance(plain_bool(add_communication), bool):
        raise ScheduleError(f"add_communication={add_communication!r} must be True or False")
    if not isinstance(placement, str) or placement not in PLACEMENTS:
        raise ScheduleError(f"placement={placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if not hasattr(table, "to_dict"):
        for i, r in enumerate(table):
            if not isinstance(r, dict) and len(r) not in (3, 5):
                raise ScheduleError(
                    f"row {i} {tuple(r)!r} has {len(r)} entries: a tuple row is (rank, kind, microbatch) or "
                    f"(rank, kind, microbatch, chunk, peer); use a dict to give some of chunk and peer only")
    rows = table.to_dict("records") if hasattr(table, "to_dict") else [
        dict(zip(("rank", "kind", "microbatch", "chunk", "peer"), r)) if not isinstance(r, dict) else r
        for r in table
    ]
    clean = []
    for i, row in enumerate(rows):
        for key in ("rank", "kind", "microbatch"):
            if key not in row:
                raise ScheduleError(f"row {i} of the table has no {key!r} column: {row}")
        if row["kind"] not in KINDS:
            raise ScheduleError(f"row {i}: unknown action kind {row['kind']!r}; expected one of {', '.join(KINDS)}")
        # A DataFrame writes a blank cell as NaN and whole numbers of a column with blanks as floats:
        # blank chunk and peer are the defaults (0, none), and 1.0 is 1; 1.5 or a blank rank is refused
        # (int() cut 1.5 to 1, and a blank chunk failed with "cannot convert float NaN to integer").
        clean.append((_table_int(row, "rank", i), row["kind"], _table_int(row, "microbatch", i),
                      _table_int(row, "chunk", i, default=0), _table_int(row, "peer", i, default=None)))
    if not clean:
        raise ScheduleError("the table has no rows: give one row per action (rank, kind, microbatch[, chunk, peer])")
    p = stages if stages is not None else 1 + max(r for r, *_ in clean)
    m = microbatches if microbatches is not None else 1 + max(mb for _, _, mb, _, _ in clean)
    v = chunks if chunks is not None else 1 + max(c for *_, c, _ in clean)
    if p * m * v > MAX_SCHEDULE_SIZE:
        raise ScheduleError(f"stages={p} x microbatches={m} x chunks={v} = {p * m * v}: at most {MAX_SCHEDULE_SIZE} "
                            f"are planned (as make_schedule); use fewer stages or fewer, larger microbatches")
    per_rank: list[list] = [[] for _ in range(p)]
    for i, (r, kind, mb, chunk, peer) in enumerate(clean):
        if not 0 <= r < p:
            raise ScheduleError(f"row {i}: rank {r} is out of range for stages={p}")
        per_rank[r].append((kind, mb, chunk, peer))
    if add_communication:
        orders = [[(k, mb, c) for k, mb, c, _ in acts] for acts in per_rank]
        return _with_communication(name, p, m, v, orders=orders, placement=placement)
    actions = tuple(tuple(Action(k, mb, c, peer) for k, mb, c, peer in acts) for acts in per_rank)
    return Schedule(name=name, stages=p, microbatches=m, chunks=v, actions=actions, placement=placement)
