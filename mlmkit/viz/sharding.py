"""Pictures of sharded data parallelism (ZeRO 1/2/3): parameter memory over a step, with the
gathered units rising and falling, and the dp bytes of each stage side by side. DataFrames in
(memory and comm traces, estimates), plotly figures out; no torch."""

from __future__ import annotations

from typing import Mapping, Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mlmkit.viz.figures import COMM, require_columns, require_rows

__all__ = ["parameter_memory_figure", "zero_bytes_figure", "zero_bytes_frame"]

#: The frames these pictures take (see :func:`mlmkit.viz.figures.require_columns`).
PARAMETER_MEMORY = (("rank", "time", "parameters", "action"), "the 'memory' frame of a trace "
                    "(Trainer.traces()['memory'], merge_traces(...)['memory'])")
ZERO_BYTES = (("stage", "rank", "measured"), "zero_bytes_frame(...)'s frame")
DP_BYTES = (("rank", "axis", "wire_bytes"), COMM[1])


def parameter_memory_figure(memory: pd.DataFrame, *, estimate: Optional[pd.DataFrame] = None,
                            title: str = "Parameter memory over one step") -> go.Figure:
    """Parameter bytes per rank over time (one panel per rank, a step line through every row of
    the memory trace: each gather of a ZeRO-3 unit adds a row), with the estimator's peak (dashed)
    if ``estimate`` (:func:`mlmkit.estimate.estimate_memory`) is given."""
    require_columns(memory, PARAMETER_MEMORY, what="parameter_memory_figure")
    require_rows(memory, what="parameter_memory_figure")
    ranks = sorted(memory["rank"].unique())
    cols = min(len(ranks), 4)
    rows = -(-len(ranks) // cols)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, subplot_titles=[f"rank {r}" for r in ranks],
                        horizontal_spacing=0.03, vertical_spacing=0.12)
    t0, kib = memory.time.min(), 2**10
    for i, r in enumerate(ranks):
        row, col = i // cols + 1, i % cols + 1
        m = memory[memory["rank"] == r].sort_values("time")
        fig.add_trace(go.Scatter(x=(m.time - t0) * 1e3, y=m.parameters / kib, mode="lines", line_shape="hv",
                                 name="parameters", legendgroup="p", showlegend=(i == 0),
                                 line=dict(color="#4C78A8"), customdata=m.action,
                                 hovertemplate="%{customdata}: %{y:.1f} KiB<extra>rank " + str(r) + "</extra>"),
                      row=row, col=col)
        if estimate is not None and r in estimate.index:
            est = float(estimate.loc[r, "parameters"]) / kib
            fig.add_trace(go.Scatter(x=[0, (m.time.max() - t0) * 1e3], y=[est, est], mode="lines", name="estimated peak",
                                     legendgroup="e", showlegend=(i == 0), line=dict(dash="dash", color="black")),
                          row=row, col=col)
    fig.update_xaxes(title_text="ms", row=rows)
    fig.update_yaxes(title_text="KiB", col=1)
    fig.update_layout(title=title, height=260 * rows + 80, plot_bgcolor="white")
    return fig


def zero_bytes_frame(comms: Mapping[int, pd.DataFrame], *, estimates: Optional[Mapping[int, pd.DataFrame]] = None,
                     steps: int = 1) -> pd.DataFrame:
    """dp wire bytes per rank and step for each ZeRO stage (``comms``: stage -> comm trace), with the
    estimates (stage -> :func:`mlmkit.estimate.estimate_comm`) and the ratio to stage 0."""
    if not isinstance(comms, Mapping):
        raise TypeError(f"zero_bytes_frame: comms must map each ZeRO stage to its comm trace ({{0: comm0, 3: comm3}}), "
                        f"got {type(comms).__name__}")
    for stage, comm in comms.items():
        require_columns(comm, DP_BYTES, what=f"zero_bytes_frame (stage {stage!r})")
    rows = []
    for stage, comm in comms.items():
        dp = comm[comm.axis == "dp"].groupby("rank").wire_bytes.sum() // steps
        for rank, measured in dp.items():
            row = {"stage": stage, "rank": rank, "measured": int(measured)}
            if estimates is not None and stage in estimates:
                row["estimated"] = int(estimates[stage].loc[rank, "dp"])
            rows.append(row)
    df = pd.DataFrame(rows)
    if 0 in comms:
        base = df[df.stage == 0].set_index("rank").measured
        df["vs zero 0"] = df.measured / df["rank"].map(base)
    return df


def zero_bytes_figure(frame: pd.DataFrame, *, title: str = "dp bytes per rank and step by ZeRO stage") -> go.Figure:
    """Grouped bars of :func:`zero_bytes_frame`: one group per rank, one bar per stage, the estimate
    as a marker on each bar."""
    require_columns(frame, ZERO_BYTES, what="zero_bytes_figure")
    fig = go.Figure()
    colors = {0: "#9D9D9D", 1: "#4C78A8", 2: "#F58518", 3: "#E45756"}
    for stage, part in frame.groupby("stage"):
        fig.add_trace(go.Bar(x=[f"rank {r}" for r in part["rank"]], y=part.measured / 2**10, name=f"zero {stage}",
                             offsetgroup=str(stage), marker_color=colors.get(stage),
                             hovertemplate=f"zero {stage}: " + "%{y:.1f} KiB<extra></extra>"))
        if "estimated" in part:
            fig.add_trace(go.Scatter(x=[f"rank {r}" for r in part["rank"]], y=part.estimated / 2**10, mode="markers",
                                     name="estimated", legendgroup="est", showlegend=bool(stage == frame.stage.min()),
                                     offsetgroup=str(stage), marker=dict(symbol="line-ew-open", size=18, color="black")))
    fig.update_layout(title=title, barmode="group", yaxis_title="KiB", plot_bgcolor="white")
    return fig
