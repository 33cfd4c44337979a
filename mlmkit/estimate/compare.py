"""Measured against estimated: tables with both numbers and their ratio (pure pandas)."""

from __future__ import annotations

import numbers
from typing import Optional

__all__ = ["compare_comm", "compare_memory", "measured_comm", "measured_memory"]

MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")
AXES = ("tp", "cp", "tp-cp", "ep", "expert-tp", "pp", "dp", "expert-dp", "embedding", "world")


def measured_memory(memory):
    """Per rank: the largest parameters/gradients/optimizer bytes seen and the activation peak."""
    g = memory.groupby("rank")
    out = g[["parameters", "gradients", "optimizer"]].max()
    out["activations"] = g["activations_peak"].max()
    return out


def _step_count(comm, steps: Optional[int]) -> int:
    held = comm["step"].nunique() if "step" in comm.columns and len(comm) else None
    if steps is None:
        return held or 1
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a whole number of steps >= 1 (or None: counted from the trace)")
    if held is not None and held != steps:
        raise ValueError(f"steps={steps} but the trace holds {held} steps (its 'step' column): leave steps out "
                         f"(it is counted from the trace), or clear the traces before the step to compare")
    return steps


def measured_comm(comm, *, steps: Optional[int] = None):
    """Wire bytes per rank and axis, per step: the mean of the steps the trace holds (its ``step``
    column; ``steps``: how many, for a frame without that column)."""
    steps = _step_count(comm, steps)
    table = comm.pivot_table(index="rank", columns="axis", values="wire_bytes", aggfunc="sum", fill_value=0)
    for axis in AXES:
        if axis not in table:
            table[axis] = 0
    return (table[list(AXES)] // steps).astype("int64")


def _long(measured, estimated, kinds):
    import pandas as pd

    rows = []
    for rank in estimated.index:
        for kind in kinds:
            est = float(estimated.loc[rank, kind])
            got = float(measured.loc[rank, kind]) if rank in measured.index else float("nan")
            rows.append({"rank": rank, "kind": kind, "measured": got, "estimated": est,
                         "ratio": got / est if est else (1.0 if got == 0 else float("inf"))})
    return pd.DataFrame(rows)


def compare_memory(memory, estimated):
    """Long table (rank, kind, measured, estimated, ratio) from a memory trace and estimate_memory()."""
    return _long(measured_memory(memory), estimated, MEMORY_KINDS)


def compare_comm(comm, estimated, *, steps: Optional[int] = None):
    """Long table (rank, kind=axis, measured, estimated, ratio) from a comm trace and estimate_comm().
    A rank without any traced message is ``NaN`` (not traced), except the only rank of a
    one-process run, which has nobody to talk to (0 bytes)."""
    measured = measured_comm(comm, steps=steps)
    if len(estimated.index) == 1 and measured.empty:
        measured = measured.reindex(estimated.index, fill_value=0)
    return _long(measured, estimated, AXES)
