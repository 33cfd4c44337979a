"""Pictures of a plan (:func:`mlmkit.plan.plan`'s table): where each layout's step time goes, and
its memory per GPU against the GPU's. DataFrames in, plotly figures out; no torch."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from mlmkit.viz.figures import require_columns

__all__ = ["PLAN_PARTS", "plan_breakdown_figure", "plan_memory_figure", "plan_vs_measured_figure"]

#: The parts of a predicted step, in stacking order, with their colours.
PLAN_PARTS = {"compute_s": ("compute", "#4C78A8"), "tp_comm_s": ("tp comm", "#F58518"),
              "cp_comm_s": ("cp comm (exposed)", "#EECA3B"), "ep_comm_s": ("ep all-to-all", "#B279A2"),
              "pp_comm_s": ("pp messages", "#72B7B2"), "bubble_s": ("pipeline bubble", "#BAB0AC"),
              "dp_comm_s": ("dp comm (exposed)", "#E45756"), "optimizer_s": ("optimizer", "#54A24B")}


#: The frames these pictures take (see :func:`mlmkit.viz.figures.require_columns`).
_LAYOUT = ("tp", "cp", "pp", "dp", "chunks", "micro_batch_size", "recompute", "zero")
PLAN = (_LAYOUT, "a plan: mlmkit.plan.plan(...)'s table (or a DataFrame of mlmkit.plan.predict(...) rows)")
PLAN_MEMORY = (_LAYOUT + ("memory_per_gpu_bytes", "state_bytes", "activation_bytes"), PLAN[1])
PLAN_VS_MEASURED = (("predicted_s", "measured_s"), "one row per layout with the predicted and the measured "
                    "step in seconds (benchmarks.bench_plan.local_comparison(...)'s frame)")


def _label(row) -> str:
    return (f"tp{row.tp} cp{row.cp} pp{row.pp} dp{row.dp} v{row.chunks} b{row.micro_batch_size} "
            f"{row.recompute[:4]} z{row.zero}")


def plan_breakdown_figure(table: pd.DataFrame, *, top: int = 10, title: Optional[str] = None) -> go.Figure:
    """Stacked horizontal bars: each of the ``top`` first layouts' step time split into compute,
    exposed communication per axis, bubble and optimizer (seconds), best layout on top."""
    require_columns(table, PLAN, what="plan_breakdown_figure")
    if not any(col in table for col in PLAN_PARTS):
        raise ValueError(f"plan_breakdown_figure: the table has none of the step's parts ({', '.join(PLAN_PARTS)}); "
                         f"expected {PLAN[1]}")
    part = table.head(top)
    labels = [_label(r) for r in part.itertuples()]
    fig = go.Figure()
    for col, (name, color) in PLAN_PARTS.items():
        if col in part and part[col].sum() > 0:
            fig.add_trace(go.Bar(y=labels, x=part[col], orientation="h", name=name, marker_color=color,
                                 hovertemplate=f"{name}: " + "%{x:.3f} s<extra></extra>"))
    fig.update_layout(barmode="stack", title=title or "Where the step time goes (predicted)",
                      xaxis_title="seconds per step", yaxis=dict(autorange="reversed"), plot_bgcolor="white",
                      height=120 + 28 * len(part), legend=dict(orientation="h", y=-0.2))
    return fig


def plan_memory_figure(table: pd.DataFrame, *, gpu_memory_bytes: float, top: int = 10) -> go.Figure:
    """Memory per GPU of the ``top`` first layouts (model state and activations, with the allowance
    on top), against the GPU's memory (dashed)."""
    require_columns(table, PLAN_MEMORY, what="plan_memory_figure")
    part = table.head(top)
    labels = [_label(r) for r in part.itertuples()]
    gib = 2**30
    other = part.memory_per_gpu_bytes - part.state_bytes - part.activation_bytes
    fig = go.Figure([
        go.Bar(y=labels, x=part.state_bytes / gib, orientation="h", name="model state", marker_color="#4C78A8"),
        go.Bar(y=labels, x=part.activation_bytes / gib, orientation="h", name="activations", marker_color="#F58518"),
        go.Bar(y=labels, x=other / gib, orientation="h", name="buffers and fragmentation", marker_color="#BAB0AC"),
    ])
    fig.add_vline(x=gpu_memory_bytes / gib, line_dash="dash", annotation_text="GPU memory")
    fig.update_layout(barmode="stack", title="Memory per GPU (predicted, largest stage)", xaxis_title="GiB",
                      yaxis=dict(autorange="reversed"), plot_bgcolor="white", height=120 + 28 * len(part),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def plan_vs_measured_figure(frame: pd.DataFrame, *, title: Optional[str] = None) -> go.Figure:
    """Grouped bars per layout (the frame's index): the planner's predicted step beside the measured
    one (columns ``predicted_s`` and ``measured_s``, seconds; shown in milliseconds on a log axis, so
    that layouts far apart stay readable), with each prediction's ratio to the measurement."""
    require_columns(frame, PLAN_VS_MEASURED, what="plan_vs_measured_figure")
    fig = go.Figure()
    labels = [str(i) for i in frame.index]
    fig.add_bar(name="predicted", x=labels, y=frame.predicted_s * 1e3, marker_color="#4C78A8",
                text=[f"{r:.2f}x" for r in frame.predicted_s / frame.measured_s], textposition="outside")
    fig.add_bar(name="measured", x=labels, y=frame.measured_s * 1e3, marker_color="#F58518")
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="step time (ms, log scale)",
                      title=title or "Planner's prediction against the measured step (label: predicted / measured)",
                      legend_orientation="h", legend_y=-0.2)
    return fig
