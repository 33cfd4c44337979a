"""Pipeline schedules as data: for each rank, the ordered list of actions it performs in one step.

Pure planning code (no torch). The same :class:`Schedule` object is validated
(:mod:`~mlmkit.pipeline.validate`), simulated (:mod:`~mlmkit.pipeline.simulate`), drawn
(:mod:`mlmkit.viz`) and executed on real ranks (:mod:`~mlmkit.pipeline.executor`).

Vocabulary:
- ``p`` = ``stages``: pipeline ranks; ``m`` = ``microbatches``; ``v`` = ``chunks``: model chunks per
  rank (interleaving). Chunk ``c`` of rank ``r`` is *virtual stage* ``c * p + r`` (Megatron-LM's
  layout), so there are ``p * v`` virtual stages and activations flow ``r -> r+1`` and wrap from the
  last rank back to rank 0 at chunk boundaries.
- Compute actions: ``F`` (forward), ``B`` (backward; backward-for-inputs only when the schedule
  splits backward), ``W`` (backward-for-weights, split schedules only).
- Communication actions: ``SEND_ACT``/``RECV_ACT`` (activations, forward direction) and
  ``SEND_GRAD``/``RECV_GRAD`` (gradients, backward direction), each naming its peer rank.

Generators (:func:`make_schedule`): ``"gpipe"`` (Huang et al. 2019), ``"1f1b"`` (PipeDream-Flush,
Narayanan et al. 2021a), ``"interleaved-1f1b"`` (Narayanan et al. 2021b, Megatron-LM's order) and
``"zb-h1"`` (zero bubble, Qi et al. 2023, backward split into B and W).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence

__all__ = [
    "COMPUTE", "COMM", "KINDS", "Action", "Schedule", "ScheduleError", "SCHEDULES", "make_schedule",
    "schedule_from_table",
]

COMPUTE = ("F", "B", "W")
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
        split_backward: backward is split into B (inputs) and W (weights).
        actions: ``actions[r]`` is rank r's ordered tuple of :class:`Action`.
        notes: remarks of the generator worth showing a user (e.g. a large bubble).
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    notes: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank

    def rank_of(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding a virtual stage."""
        return virtual_stage % self.stages, virtual_stage // self.stages

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


def _interleaved(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    # Megatron-LM's order: the k-th forward of a rank runs chunk (k // p) % v on microbatch
    # (k // (p v)) p + k % p; backwards visit chunks in reverse. Needs m % p == 0.
    total = m * v

    def fwd(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
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
            orders[r].append(("B", mb, 0))
            next_b[r] += 1
            between_f_and_b[r] -= 1
            pending_w[r].append(mb)
            if r > 0:
                b_arrival[r - 1][mb] = now + 1
        elif pending_w[r] and (len(pending_w[r]) > w_cap or f_time is None or f_time > now):
            orders[r].append(("W", pending_w[r].pop(0), 0))
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


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(f"{name}={value!r} must be an integer >= {minimum}")


def make_schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1,
                  layers: Optional[int] = None) -> Schedule:
    """Generate a named schedule (one of :data:`SCHEDULES`) for ``stages`` pipeline ranks.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zb-h1"``.
        stages: pipeline ranks ``p``. microbatches: ``m``. chunks: model chunks per rank ``v``
            (only interleaved-1f1b takes ``v > 1``).
        layers: if given, checked to divide into ``p * v`` stages of at least one layer.

    Raises:
        ScheduleError: with the offending value and the rule it breaks.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    _check_int("stages", stages)
    _check_int("microbatches", microbatches)
    _check_int("chunks", chunks)
    p, m, v = stages, microbatches, chunks
    if name != "interleaved-1f1b" and v != 1:
        raise ScheduleError(f"chunks={v}: only 'interleaved-1f1b' runs more than one model chunk per rank")
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
    if name == "interleaved-1f1b":
        if v < 2:
            raise ScheduleError("interleaved-1f1b needs chunks >= 2 (with chunks=1 it is plain '1f1b')")
        if m % p:
            raise ScheduleError(
                f"interleaved-1f1b needs microbatches divisible by stages (Megatron-LM's rule): "
                f"microbatches={m}, stages={p}; use {-(-m // p) * p}"
            )
    if layers is not None:
        _check_int("layers", layers)
        if p * v > layers:
            raise ScheduleError(f"{p * v} stages (stages={p} x chunks={v}) but only layers={layers}")
        if layers % (p * v) and v > 1:
            raise ScheduleError(
                f"chunks={v} does not divide the layers: layers={layers} is not divisible by "
                f"stages x chunks = {p * v}"
            )
    orders = {
        "gpipe": lambda: _gpipe(p, m),
        "1f1b": lambda: _one_f_one_b(p, m),
        "interleaved-1f1b": lambda: _interleaved(p, m, v),
        "zb-h1": lambda: _zb_h1(p, m),
    }[name]()
    return _with_communication(name, p, m, v, split_backward=(name == "zb-h1"), orders=orders, notes=notes)


def _with_communication(name: str, p: int, m: int, v: int, *, split_backward: bool,
                        orders: Sequence[Iterable[tuple[str, int, int]]], notes: tuple[str, ...] = ()) -> Schedule:
    """Insert sends and receives around compute actions: receive just before use, send just after."""
    last = p * v - 1
    actions = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for kind, mb, c in order:
            s = c * p + r
            if kind == "F":
                if s > 0:
                    acts.append(Action("RECV_ACT", mb, c, (s - 1) % p))
                acts.append(Action("F", mb, c))
                if s < last:
                    acts.append(Action("SEND_ACT", mb, c, (s + 1) % p))
            elif kind == "B":
                if s < last:
                    acts.append(Action("RECV_GRAD", mb, c, (s + 1) % p))
                acts.append(Action("B", mb, c))
                if s > 0:
                    acts.append(Action("SEND_GRAD", mb, c, (s - 1) % p))
            else:
                acts.append(Action(kind, mb, c))
        actions.append(tuple(acts))
    return Schedule(name=name, stages=p, microbatches=m, chunks=v, split_backward=split_backward,
                    actions=tuple(actions), notes=notes)


def schedule_from_table(table, *, stages: Optional[int] = None, microbatches: Optional[int] = None,
                        chunks: Optional[int] = None, name: str = "custom",
                        add_communication: bool = False) -> Schedule:
    """Build a hand-written schedule from a table (DataFrame or list of dicts / tuples).

    Rows need ``rank``, ``kind``, ``microbatch`` and optionally ``chunk`` and ``peer``, in execution
    order per rank. With ``add_communication=True`` the table lists compute actions only and sends
    and receives are inserted as the generators do. The result is not validated here: pass it to
    :func:`mlmkit.pipeline.validate` (the executor does so before running anything).
    """
    rows = table.to_dict("records") if hasattr(table, "to_dict") else [
        dict(zip(("rank", "kind", "microbatch", "chunk", "peer"), r)) if not isinstance(r, dict) else r
        for r in table
    ]
    for i, row in enumerate(rows):
        for key in ("rank", "kind", "microbatch"):
            if key not in row:
                raise ScheduleError(f"row {i} of the table has no {key!r} column: {row}")
        if row["kind"] not in KINDS:
            raise ScheduleError(f"row {i}: unknown action kind {row['kind']!r}; expected one of {', '.join(KINDS)}")
    p = stages if stages is not None else 1 + max(int(r["rank"]) for r in rows)
    m = microbatches if microbatches is not None else 1 + max(int(r["microbatch"]) for r in rows)
    v = chunks if chunks is not None else 1 + max(int(r.get("chunk", 0) or 0) for r in rows)
    per_rank: list[list] = [[] for _ in range(p)]
    for i, row in enumerate(rows):
        r = int(row["rank"])
        if not 0 <= r < p:
            raise ScheduleError(f"row {i}: rank {r} is out of range for stages={p}")
        peer = row.get("peer")
        peer = None if peer is None or peer != peer else int(peer)  # NaN -> None
        per_rank[r].append((row["kind"], int(row["microbatch"]), int(row.get("chunk", 0) or 0), peer))
    split = any(k == "W" for acts in per_rank for k, *_ in acts)
    if add_communication:
        orders = [[(k, mb, c) for k, mb, c, _ in acts] for acts in per_rank]
        return _with_communication(name, p, m, v, split_backward=split, orders=orders)
    actions = tuple(tuple(Action(k, mb, c, peer) for k, mb, c, peer in acts) for acts in per_rank)
    return Schedule(name=name, stages=p, microbatches=m, chunks=v, split_backward=split, actions=actions)
