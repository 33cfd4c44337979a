"""Pictures of context parallelism: who holds which tokens, what each rank computes at each ring
step, the ring on a timeline, and memory per rank against cp. DataFrames and the pure planning
functions of :mod:`mlmkit.context_parallel.split` in, plotly figures out; no torch."""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mlmkit.context_parallel.split import attention_work, chunk_count, held_positions, ring_steps
from mlmkit.viz.figures import COMM, require_columns

__all__ = ["cp_memory_figure", "cp_split_figure", "cp_work_frame", "ring_timeline_figure"]

_RANK_SCALE = "Turbo"
#: The frames these pictures take (see :func:`mlmkit.viz.figures.require_columns`).
RING = (("rank", "site", "phase", "step", "src", "pairs", "start", "end"),
        "the 'ring' frame of a trace of a cp > 1 run (Trainer.traces()['ring'], merge_traces(...)['ring'])")
RING_COMM = (("rank", "op", "axis", "bytes", "site", "start", "end"), COMM[1])
CP_MEMORY = (("cp", "measured", "estimated"), "one row per cp degree with the measured and estimated bytes")


def _ranges(positions: list[int]) -> str:
    # [0, 1, 2, 3, 12, 13] -> "0-3, 12-13"
    out, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            out.append(f"{start}-{p}" if p != start else f"{p}")
            start = None
    return ", ".join(out)


def cp_work_frame(seq_len: int, cp: int, split: str = "balanced") -> pd.DataFrame:
    """One row per (ring step, cp rank): whose keys/values it holds (``src``), the query and key
    positions its segments cover, whether masked (``causal``) and the (query, key) pairs computed
    (from :func:`~mlmkit.context_parallel.split.ring_steps`)."""
    rows = []
    for r in range(cp):
        mine = held_positions(seq_len, cp, r, split)
        for j, (src, segments) in enumerate(ring_steps(seq_len, cp, r, split)):
            theirs = held_positions(seq_len, cp, src, split)
            queries = sorted({mine[i] for s in segments for i in range(*s.rows)})
            keys = sorted({theirs[i] for s in segments for i in range(*s.cols)})
            rows.append({"step": j, "rank": r, "src": src, "queries": _ranges(queries) or "-",
                         "keys": _ranges(keys) or "-", "causal": any(s.causal for s in segments),
                         "pairs": sum(s.pairs for s in segments)})
    return pd.DataFrame(rows)


def cp_split_figure(seq_len: int, cp: int, split: str = "balanced") -> go.Figure:
    """Top: which cp rank holds each token. Below, one panel per ring step: the causal attention
    matrix (query position down, key position across), each (query, key) pair coloured by the
    rank that computes it at that step; blank where nothing is computed. The title gives the
    pairs each rank computes over the whole ring (equal for the balanced split)."""
    if seq_len > 512:
        raise ValueError(f"cp_split_figure draws every (query, key) pair: seq_len={seq_len} is too many; use <= 512")
    owner = [0] * seq_len
    for r in range(cp):
        for pos in held_positions(seq_len, cp, r, split):
            owner[pos] = r
    fig = make_subplots(rows=2, cols=cp, row_heights=[0.12, 0.88], vertical_spacing=0.2, horizontal_spacing=0.03,
                        specs=[[{"colspan": cp}] + [None] * (cp - 1), [{}] * cp],
                        subplot_titles=["tokens held (colour = cp rank)"]
                        + [f"ring step {j}" + (" (own keys/values)" if j == 0 else "") for j in range(cp)])
    fig.add_trace(go.Heatmap(z=[owner], x=list(range(seq_len)), y=["held by"], zmin=0, zmax=max(cp - 1, 1),
                             colorscale=_RANK_SCALE, showscale=False,
                             hovertemplate="position %{x}: rank %{z}<extra></extra>"), row=1, col=1)
    for j in range(cp):
        z = [[math.nan] * seq_len for _ in range(seq_len)]
        for r in range(cp):
            mine = held_positions(seq_len, cp, r, split)
            src, segments = ring_steps(seq_len, cp, r, split)[j]
            theirs = held_positions(seq_len, cp, src, split)
            for seg in segments:
                for qi in range(*seg.rows):
                    for ki in range(*seg.cols):
                        if not seg.causal or theirs[ki] <= mine[qi]:
                            z[mine[qi]][theirs[ki]] = r
        fig.add_trace(go.Heatmap(z=z, zmin=0, zmax=max(cp - 1, 1), colorscale=_RANK_SCALE, showscale=j == cp - 1,
                                 colorbar=dict(title="cp rank", dtick=1),
                                 hovertemplate="query %{y}, key %{x}: rank %{z}<extra></extra>"), row=2, col=j + 1)
        fig.update_yaxes(autorange="reversed", row=2, col=j + 1, title="query position" if j == 0 else None)
        fig.update_xaxes(title="key position", row=2, col=j + 1)
    work = attention_work(seq_len, cp, split)
    fig.update_layout(title=f"{split} split, cp={cp}, s={seq_len} ({chunk_count(cp, split)} chunks): "
                            f"pairs computed per rank {work}", height=420, plot_bgcolor="white")
    return fig


def ring_timeline_figure(ring: pd.DataFrame, comm: Optional[pd.DataFrame] = None, *, t0: Optional[float] = None,
                         title: str = "Ring attention on a timeline") -> go.Figure:
    """One row per rank: each ring step's attention compute (from a ``ring`` trace, forward and
    backward coloured apart, labelled with the step) and, if ``comm`` is given, the cp messages
    below it (from post to completion). A rank with less to compute shows gaps: it waits for the
    next block."""
    require_columns(ring, RING, what="ring_timeline_figure")
    if comm is not None:
        require_columns(comm, RING_COMM, what="ring_timeline_figure (comm)")
    if not len(ring):
        raise ValueError("ring_timeline_figure: the ring frame has no rows: the traced run has no ring attention "
                         "(cp=1), or the filter left none; trace a step of a run with cp > 1")
    frames = [ring] + ([comm[comm.axis == "cp"]] if comm is not None else [])
    t0 = min(f.start.min() for f in frames if len(f)) if t0 is None else t0
    fig = go.Figure()
    colors = {"forward": "#4C78A8", "backward": "#F58518"}
    for phase in ("forward", "backward"):
        part = ring[ring.phase == phase]
        if len(part):
            fig.add_trace(go.Bar(y=part["rank"], x=(part.end - part.start).clip(lower=1e-6), base=part.start - t0,
                                 orientation="h", name=f"attention {phase}", marker_color=colors[phase],
                                 text=[f"{s}" for s in part.step], textposition="inside",
                                 customdata=part[["site", "step", "src", "pairs"]].values,
                                 hovertemplate="%{customdata[0]} step %{customdata[1]}: keys of cp rank "
                                               "%{customdata[2]}, %{customdata[3]} pairs<extra></extra>"))
    if comm is not None:
        sends = comm[(comm.axis == "cp") & (comm.op == "send")]
        if len(sends):
            fig.add_trace(go.Bar(y=sends["rank"] + 0.35, x=(sends.end - sends.start).clip(lower=1e-6),
                                 base=sends.start - t0, orientation="h", width=0.2, name="cp send (posted → done)",
                                 marker_color="#E45756", customdata=sends[["site", "bytes"]].values,
                                 hovertemplate="%{customdata[0]}: %{customdata[1]} B<extra></extra>"))
    ranks = sorted(ring["rank"].unique())
    fig.update_layout(title=title, barmode="overlay", plot_bgcolor="white",
                      yaxis=dict(autorange="reversed", tickvals=ranks, ticktext=[f"rank {r}" for r in ranks]),
                      xaxis=dict(title="time (s)"), height=140 + 50 * len(ranks))
    return fig


def cp_memory_figure(frame: pd.DataFrame) -> go.Figure:
    """Activation memory per rank against cp: ``frame`` has columns ``cp``, ``measured`` and
    ``estimated`` (bytes, e.g. the peak over ranks of each run); the dotted line is cp=1's
    measurement divided by cp."""
    require_columns(frame, CP_MEMORY, what="cp_memory_figure")
    df = frame.sort_values("cp")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=df.cp.astype(str), y=df.measured / 2**10, name="measured", marker_color="#E45756"))
    fig.add_trace(go.Scatter(x=df.cp.astype(str), y=df.estimated / 2**10, mode="markers", name="estimated",
                             marker=dict(symbol="line-ew-open", size=36, color="black", line=dict(width=2))))
    if (df.cp == 1).any():
        base = float(df[df.cp == 1].measured.iloc[0])
        fig.add_trace(go.Scatter(x=df.cp.astype(str), y=base / df.cp / 2**10, mode="lines+markers",
                                 name="cp=1 / cp", line=dict(dash="dot", color="gray")))
    fig.update_layout(title="Activation memory per rank vs cp", xaxis=dict(title="cp"),
                      yaxis=dict(title="peak activation bytes (KiB)"), plot_bgcolor="white")
    return fig
