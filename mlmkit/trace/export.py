"""Gather per-rank traces into one set of DataFrames, and export them as a Chrome trace (Perfetto)."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

__all__ = ["merge_traces", "to_chrome_trace"]


#: The time columns of each kind of frame.
TIME_COLUMNS = {"events": ("start", "end"), "comm": ("start", "end"), "memory": ("time",), "ring": ("start", "end")}


def merge_traces(per_rank: Iterable[dict]) -> dict:
    """Concatenate each kind of frame (``events``, ``comm``, ``memory``, ``ring``, ``moe``) over ranks:
    ``per_rank`` is each rank's :meth:`Trainer.traces`, as a list or a dict by rank (``Cluster.run``'s).

    Times are seconds of ``time.perf_counter`` (CLOCK_MONOTONIC), which the processes of one
    machine share. Each machine has its own (it counts from its boot): when the ranks' traces say
    (their ``clock``, from :meth:`Trainer.traces`) that they ran on more than one host, each rank's
    times are moved onto the wall clock (``time.time()``, which NTP keeps within about a millisecond
    across a cluster's nodes), and ``clock`` says so (``"wall"``; ``"monotonic"`` otherwise): without
    that, a pipeline's stages on two nodes sat hours apart, and every step looked like one long
    bubble. ``t0`` is the earliest start, for plotting from zero.
    """
    import pandas as pd

    if isinstance(per_rank, Mapping):        # {rank: traces}, as Cluster.run returns them
        per_rank = [per_rank[r] for r in sorted(per_rank)]
    per_rank = list(per_rank)
    for i, d in enumerate(per_rank):
        if not isinstance(d, Mapping):
            raise ValueError(f"merge_traces: item {i} is a {type(d).__name__}, not one rank's traces (a dict of "
                             f"frames from Trainer.traces()); pass a list of them, or a dict by rank")
    hosts = {d["clock"]["host"] for d in per_rank if "clock" in d}
    wall = len(hosts) > 1
    if wall and not all("clock" in d for d in per_rank):
        raise ValueError("merge_traces: the traces come from several hosts, and some say nothing of their clock: "
                         "their times cannot be put on one axis (pass every rank's Trainer.traces())")
    out = {}
    for kind in ("events", "comm", "memory", "ring", "moe"):
        if per_rank and kind not in per_rank[0]:
            continue
        frames = []
        for d in per_rank:
            if kind not in d or not len(d[kind]):
                continue
            frame = d[kind]
            if wall and kind in TIME_COLUMNS:
                shift = d["clock"]["wall_minus_monotonic"]
                frame = frame.assign(**{c: frame[c] + shift for c in TIME_COLUMNS[kind] if c in frame})
            frames.append(frame)
        out[kind] = pd.concat(frames, ignore_index=True) if frames else (per_rank[0][kind] if per_rank else pd.DataFrame())
    starts = [out[k][c].min() for k, c in (("events", "start"), ("comm", "start"), ("memory", "time"))
              if len(out.get(k, ())) and c in out[k]]
    out["t0"] = float(min(starts)) if starts else 0.0
    out["clock"] = "wall" if wall else "monotonic"
    return out


def to_chrome_trace(traces: dict, path: str) -> str:
    """Write ``traces`` (from :func:`merge_traces`) as Chrome-trace JSON: one process per rank, a
    "compute" thread with the schedule actions, a "comm" thread with collectives and messages, a
    "ring attention" thread with the ring steps (context parallelism), and memory counters. Opens in Perfetto (ui.perfetto.dev) and chrome://tracing."""
    t0 = traces.get("t0", 0.0)
    us = lambda t: (float(t) - t0) * 1e6  # noqa: E731
    events = []
    ranks = set()
    for row in traces["events"].itertuples(index=False):
        ranks.add(int(row.rank))
        events.append({"name": f"{row.action}{row.microbatch}" + (f".{row.chunk}" if row.chunk else ""),
                       "cat": row.action, "ph": "X", "pid": int(row.rank), "tid": 0, "ts": us(row.start),
                       "dur": max(0.0, us(row.end) - us(row.start)),
                       "args": {"microbatch": int(row.microbatch), "chunk": int(row.chunk),
                                **({"step": int(row.step)} if hasattr(row, "step") else {})}})
    for row in traces["comm"].itertuples(index=False):
        ranks.add(int(row.rank))
        events.append({"name": f"{row.op} {row.axis}", "cat": "comm", "ph": "X", "pid": int(row.rank), "tid": 1,
                       "ts": us(row.start), "dur": max(0.0, us(row.end) - us(row.start)),
                       "args": {"bytes": int(row.bytes), "wire_bytes": int(row.wire_bytes), "site": row.site,
                                "ranks": list(row.ranks), "phase": row.phase,
                                **({"step": int(row.step)} if hasattr(row, "step") else {})}})
    ring = traces.get("ring")
    if ring is not None and len(ring):
        for row in ring.itertuples(index=False):
            ranks.add(int(row.rank))
            events.append({"name": f"ring {row.phase[0].upper()} step {row.step}", "cat": "ring", "ph": "X",
                           "pid": int(row.rank), "tid": 2, "ts": us(row.start),
                           "dur": max(0.0, us(row.end) - us(row.start)),
                           "args": {"site": row.site, "kv_of_cp_rank": int(row.src), "pairs": int(row.pairs)}})
    mem = traces.get("memory")
    if mem is not None and len(mem):
        for row in mem.itertuples(index=False):
            events.append({"name": "memory", "ph": "C", "pid": int(row.rank), "ts": us(row.time),
                           "args": {k: int(getattr(row, k)) for k in ("parameters", "gradients", "optimizer", "activations")}})
    for r in sorted(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "comm"}})
        if ring is not None and len(ring):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 2, "args": {"name": "ring attention"}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
