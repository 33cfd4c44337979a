"""Measured against estimated: tables with both numbers and their ratio (pure pandas)."""

from __future__ import annotations

__all__ = ["compare_comm", "compare_memory", "measured_comm", "measured_memory"]

MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")
AXES = ("tp", "cp", "tp-cp", "ep", "expert-tp", "pp", "dp", "expert-dp", "embedding", "world")


def measured_memory(memory):
    """Per rank: the largest parameters/gradients/optimizer bytes seen and the activation peak."""
    g = memory.groupby("rank")
    out = g[["parameters", "gradients", "optimizer"]].max()
    out["activations"] = g["activations_peak"].max()
    return out


def measured_comm(comm, *, steps: int = 1):
    """Wire bytes per rank and axis, per step (``steps``: how many steps the frame holds)."""
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


def compare_comm(comm, estimated, *, steps: int = 1):
    """Long table (rank, kind=axis, measured, estimated, ratio) from a comm trace and estimate_comm().
    A rank without any traced message is ``NaN`` (not traced), except the only rank of a
    one-process run, which has nobody to talk to (0 bytes)."""
    measured = measured_comm(comm, steps=steps)
    if len(estimated.index) == 1 and measured.empty:
        measured = measured.reindex(estimated.index, fill_value=0)
    return _long(measured, estimated, AXES)
