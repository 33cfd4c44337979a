"""Pictures of a mixture of experts: tokens per expert (per rank and layer, against the even load),
the all-to-all matrix, dropped tokens, and the load-balancing loss over training. DataFrames in
(a ``moe`` trace, a ``comm`` trace, training metrics), plotly figures out; no torch."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mlmkit.viz.figures import COMM, comm_matrix, require_columns

__all__ = ["all_to_all_figure", "expert_load", "expert_load_figure", "moe_training_figure"]

#: The frames these pictures take (see :func:`mlmkit.viz.figures.require_columns`).
MOE = (("rank", "site", "routed", "kept", "dropped"), "the 'moe' frame of a trace of a mixture-of-experts model "
       "(Trainer.traces()['moe'], merge_traces(...)['moe'], Session.traces()['moe'])")
METRICS = (("step", "loss"), "training metrics: a DataFrame of the rows Trainer.train_step() returns, or "
           "Session.metrics()")


def _require_moe(moe, what: str) -> None:
    require_columns(moe, MOE, what=what)
    if not len(moe):
        raise ValueError(f"{what}: the moe frame has no rows: the traced model has no mixture-of-experts layer "
                         f"(experts=0), or no step was traced; trace a step of a model with experts > 0")


def expert_load(moe: pd.DataFrame, *, column: str = "routed") -> pd.DataFrame:
    """Assignments per expert (columns) summed over the calls of each (layer, rank) (rows), from a
    ``moe`` trace (:data:`mlmkit.trace.MOE_COLUMNS`); ``column`` "routed" (before capacity) or "kept"."""
    if column not in ("routed", "kept"):
        raise ValueError(f"expert_load: column={column!r}; expected 'routed' (before the capacity) or 'kept'")
    _require_moe(moe, "expert_load")
    rows = []
    for (site, rank), part in moe.groupby(["site", "rank"], sort=True):
        counts = [sum(x) for x in zip(*part[column])]
        rows.append({"layer": site, "rank": rank, **{e: c for e, c in enumerate(counts)}})
    return pd.DataFrame(rows).set_index(["layer", "rank"])


def expert_load_figure(moe: pd.DataFrame, *, title: str = "Tokens per expert") -> go.Figure:
    """Left: a heat map of the assignments each rank's tokens sent to each expert, one row per
    (layer, rank). Right: the total per expert over ranks and layers, with the even load (total /
    experts) as a line; the title gives the dropped assignments (capacity mode)."""
    _require_moe(moe, "expert_load_figure")
    load = expert_load(moe)
    total = load.sum(axis=0)
    even = total.sum() / len(total)
    dropped = int(moe.dropped.sum())
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.12,
                        subplot_titles=["per layer and rank", "all layers and ranks"])
    fig.add_trace(go.Heatmap(z=load.values, x=[f"expert {e}" for e in load.columns],
                             y=[f"{layer.split('.')[1]}/rank {r}" for layer, r in load.index], colorscale="Blues",
                             colorbar=dict(title="tokens", x=0.55),
                             hovertemplate="layer/rank %{y}, %{x}: %{z} tokens<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=[f"expert {e}" for e in total.index], y=total.values, name="tokens",
                         marker_color="#4C78A8"), row=1, col=2)
    fig.add_trace(go.Scatter(x=[f"expert {e}" for e in total.index], y=[even] * len(total), mode="lines",
                             name="even load", line=dict(dash="dash", color="black")), row=1, col=2)
    fig.update_yaxes(autorange="reversed", title="layer / rank", row=1, col=1)
    fig.update_yaxes(title="tokens", row=1, col=2)
    imbalance = total.max() / even if even else float("nan")
    fig.update_layout(title=f"{title}: busiest expert {imbalance:.2f}x the even load, {dropped} assignments dropped",
                      height=200 + 24 * len(load), plot_bgcolor="white", showlegend=False)
    return fig


def all_to_all_figure(comm: pd.DataFrame) -> go.Figure:
    """Bytes each rank sent to each rank through the expert all-to-alls (dispatch, combine, their
    backward, the counts), from a ``comm`` trace."""
    require_columns(comm, COMM, what="all_to_all_figure")
    part = comm[comm.axis == "ep"]
    mat = comm_matrix(part) if len(part) else pd.DataFrame()
    fig = go.Figure(go.Heatmap(z=mat.values / 2**10, x=[f"to {c}" for c in mat.columns],
                               y=[f"from {r}" for r in mat.index], colorscale="Oranges", colorbar=dict(title="KiB"),
                               hovertemplate="%{y} %{x}: %{z:.1f} KiB<extra></extra>"))
    fig.update_layout(title="Expert all-to-all: bytes between ranks", yaxis=dict(autorange="reversed"),
                      height=160 + 40 * max(1, len(mat)))
    return fig


def moe_training_figure(metrics: pd.DataFrame) -> go.Figure:
    """The language-model loss and the (weighted) load-balancing loss over training steps, from a
    trainer's or session's metrics."""
    require_columns(metrics, METRICS, what="moe_training_figure")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=metrics.step, y=metrics.loss, name="loss", mode="lines+markers"), secondary_y=False)
    if "aux_loss" in metrics:
        fig.add_trace(go.Scatter(x=metrics.step, y=metrics.aux_loss, name="load-balancing loss (weighted)",
                                 mode="lines+markers", line=dict(color="#E45756")), secondary_y=True)
    fig.update_layout(title="Training a mixture of experts", xaxis=dict(title="step"), plot_bgcolor="white")
    fig.update_yaxes(title_text="loss", secondary_y=False)
    fig.update_yaxes(title_text="aux loss", secondary_y=True)
    return fig
