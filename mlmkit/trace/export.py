"""Gather per-rank traces into one set of DataFrames, and export them as a Chrome trace (Perfetto)."""

from __future__ import annotations

import json
from typing import Iterable

__all__ = ["merge_traces", "to_chrome_trace"]


def merge_traces(per_rank: Iterable[dict]) -> dict:
    """Concatenate each kind of frame (``events``, ``comm``, ``memory``, ``ring``, ``moe``) over ranks.

    Times stay in seconds of ``time.perf_counter`` (CLOCK_MONOTONIC, shared by the processes of
    one machine); ``t0`` is the earliest start, for plotting from zero.
    """
    import pandas as pd

    per_rank = list(per_rank)
    out = {}
    for kind in ("events", "comm", "memory", "ring", "moe"):
        if per_rank and kind not in per_rank[0]:
            continue
        frames = [d[kind] for d in per_rank if kind in d and len(d[kind])]
        out[kind] = pd.concat(frames, ignore_index=True) if frames else (per_rank[0][kind] if per_rank else pd.DataFrame())
    starts = [out[k][c].min() for k, c in (("events", "start"), ("comm", "start"), ("memory", "time"))
              if len(out.get(k, ())) and c in out[k]]
    out["t0"] = float(min(starts)) if starts else 0.0
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
