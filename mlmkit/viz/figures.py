"""Plotly figures of mlmkit's DataFrames: topology, pipeline timelines, memory, communication, shards.

Every function takes DataFrames (from :mod:`mlmkit.topology`, :mod:`mlmkit.pipeline.simulate`,
:mod:`mlmkit.trace`, :mod:`mlmkit.estimate`, :func:`mlmkit.shard_table`) and returns a
``plotly.graph_objects.Figure``; nothing here imports torch. :func:`save_html` writes any of them as
a standalone HTML file (plotly.js embedded: it opens offline).
"""

from __future__ import annotations

from typing import AbstractSet, Mapping, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "ACTION_COLORS", "MEMORY_COLORS", "bubble_table", "require_columns", "require_rows", "comm_by_axis_figure",
    "comm_heatmap",
    "comm_matrix",
    "activation_peaks_figure", "comm_timeline_figure", "memory_figure", "save_html", "shard_figure", "shard_matrix_figure", "timeline_comparison", "timeline_figure",
    "topology_figure",
]

#: What each kind of frame must hold, and where such a frame comes from (for the error a user sees
#: when a figure is handed another frame).
TIMELINE = (("rank", "start", "end"), "a timeline: simulate(...).timeline, or the 'events' of a trace "
            "(Trainer.traces(), merge_traces(...), Session.traces())")
ACTIONS = (("rank", "action", "microbatch", "chunk", "start", "end"), TIMELINE[1])
COMM = (("rank", "op", "axis", "ranks", "wire_bytes"), "the 'comm' frame of a trace (Trainer.traces()['comm'], "
        "merge_traces(...)['comm'])")
COMM_TIMED = (COMM[0] + ("bytes", "site", "start", "end"), COMM[1])
MEMORY = (("rank", "time", "parameters", "gradients", "optimizer", "activations", "activations_peak"),
          "the 'memory' frame of a trace (Trainer.traces()['memory'], merge_traces(...)['memory'])")
TOPOLOGY = (("tp", "dp", "pp"),
            "a rank grid: Topology.to_frame() (index rank), optionally joined with Cluster.to_frame()")
SHARDS = (("rank", "name", "local_shape", "global_shape", "split_dim"),
          "parameter shards: mlmkit.model.shard_table(model, rank=...) of every rank (e.g. cluster.run_frame(...))")

PEAKS = (("variant", "rank", "measured MiB", "estimated MiB"),
         "one row per variant and rank: its measured and estimated peak activations in MiB (as notebook 04 builds)")


def require_columns(frame, spec, *, what: str) -> None:
    """ValueError (TypeError for no DataFrame) naming the columns ``frame`` lacks for ``what``:
    ``spec`` is (columns, where such a frame comes from), e.g. :data:`TIMELINE`."""
    columns, source = spec
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{what}: expected a pandas DataFrame ({source}), got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: the frame lacks {', '.join(map(repr, missing))} (its columns: "
                         f"{list(frame.columns)}); expected {source}")


_NOTHING_TRACED = ("nothing was recorded (a run with tracing=False, traces cleared since the last step, or a "
                   "filter that left none); trace a step first")


def require_rows(frame: pd.DataFrame, *, what: str, why: str = _NOTHING_TRACED) -> None:
    """ValueError for a frame without rows, which a figure of it cannot draw (it divided by zero)."""
    if not len(frame):
        raise ValueError(f"{what}: the frame has no rows: {why}")


ACTION_COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#54A24B"}
#: Hatching of model chunks 0, 1, 2, ... in timelines (chunk 0 plain).
CHUNK_PATTERNS = ["", "/", "x", "\\", ".", "+"]
ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "weight grad"}
MEMORY_COLORS = {"parameters": "#4C78A8", "gradients": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
#: One colour per tensor-parallel rank (shard pictures, per-rank bars).
RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D"]
AXIS_COLORS = {"tp": "#4C78A8", "cp": "#E45756", "pp": "#F58518", "dp": "#54A24B", "embedding": "#B279A2",
               "world": "#9D755D"}
BUBBLE_COLOR = "rgba(150, 150, 150, 0.35)"


def save_html(fig: go.Figure, path: str) -> str:
    """Write ``fig`` as a standalone HTML file (plotly.js included, no network needed)."""
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path


# ------------------------------------------------------------------------------------------ topology
def topology_figure(frame: pd.DataFrame, *, color_by: str = "pp") -> go.Figure:
    """The rank grid: one cell per rank (columns tp, grouped in blocks per cp rank; rows dp within
    each pipeline stage), coloured by the group of ``color_by``, with buttons to switch between the
    tp, cp, dp, dp-cp and pp groups (cp ones only when cp > 1).

    ``frame``: :meth:`Topology.to_frame` (index rank; columns tp, cp, dp, pp), optionally with a
    ``device`` / ``host`` column (e.g. joined from :meth:`Cluster.to_frame`) shown on hover.
    """
    require_columns(frame, TOPOLOGY, what="topology_figure")
    require_rows(frame, what="topology_figure", why=f"expected {TOPOLOGY[1]}")
    df = frame.reset_index()
    if "rank" not in df:
        raise ValueError(f"topology_figure: the frame has no 'rank' (index or column; its columns: "
                         f"{list(frame.columns)}); expected {TOPOLOGY[1]}")
    if "cp" not in df:
        df["cp"] = 0
    tp_n, cp_n, dp_n = int(df.tp.max()) + 1, int(df.cp.max()) + 1, int(df.dp.max()) + 1
    x = df.cp * (tp_n + 1) + df.tp            # cp blocks side by side, a blank column between them
    y = df.pp * (dp_n + 1) + df.dp            # stages stacked, a blank row between them
    extra = [c for c in ("device", "host") if c in df]
    cp_text = lambda r: f" cp={r.cp}" if cp_n > 1 else ""  # noqa: E731
    hover = [f"rank {r.rank}<br>tp={r.tp}{cp_text(r)} dp={r.dp} pp={r.pp}"
             + "".join(f"<br>{c}={getattr(r, c)}" for c in extra) for r in df.itertuples()]
    kinds = ["tp", "cp", "dp", "dp-cp", "pp"] if cp_n > 1 else ["tp", "dp", "pp"]
    if color_by not in kinds:
        raise ValueError(f"topology_figure: color_by={color_by!r}; expected one of {kinds}")

    def group_id(kind):
        varying = set(kind.split("-"))
        others = [a for a in ("tp", "cp", "dp", "pp") if a not in varying]
        return df.groupby(others).ngroup()

    fig = go.Figure()
    for kind in kinds:
        gid = group_id(kind)
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="markers+text", text=[str(r) for r in df["rank"]], textposition="middle center",
            hovertext=hover, hoverinfo="text", name=f"{kind} groups", visible=(kind == color_by),
            marker=dict(size=46, symbol="square", color=gid, colorscale="Turbo", line=dict(width=1, color="white")),
            textfont=dict(color="white", size=14), customdata=gid))
    buttons = [dict(label=f"colour by {a} group", method="update",
                    args=[{"visible": [b == a for b in kinds]}]) for a in kinds]
    stages = sorted(df.pp.unique())
    order = "tp fastest, then cp, then dp, then pp" if cp_n > 1 else "tp fastest, then dp, then pp"
    xticks = [c * (tp_n + 1) + t for c in range(cp_n) for t in range(tp_n)]
    fig.update_layout(
        title=dict(text=f"Rank grid (Megatron order: {order})", y=0.98, yanchor="top"), showlegend=False,
        height=200 + 70 * len(y.unique()), margin=dict(t=130),
        updatemenus=[dict(buttons=buttons, direction="right", x=0, y=1.03, xanchor="left", yanchor="bottom",
                          type="buttons")],
        xaxis=dict(title="tp rank" + (" (one block per cp rank)" if cp_n > 1 else ""), tickvals=xticks,
                   ticktext=[f"cp{c}.tp{t}" if cp_n > 1 else str(t) for c in range(cp_n) for t in range(tp_n)],
                   range=[-0.6, max(xticks) + 0.6]),
        yaxis=dict(title="pipeline stage / dp replica", autorange="reversed",
                   tickvals=[p * (dp_n + 1) + d for p in stages for d in range(dp_n)],
                   ticktext=[f"pp={p} dp={d}" for p in stages for d in range(dp_n)]),
        plot_bgcolor="white")
    return fig


# ------------------------------------------------------------------------------------------ timelines
def _steps(frame: pd.DataFrame) -> list:
    """The optimizer steps a trace holds (its ``step`` column); one unnamed step without one (a
    simulated timeline)."""
    if "step" not in frame.columns or not len(frame):
        return [None]
    if frame["step"].isna().any():
        raise ValueError(f"the frame's 'step' column has {int(frame['step'].isna().sum())} empty value(s) among "
                         f"{len(frame)} rows (frames of several sources concatenated?): give every row its step, "
                         f"or drop the column for a single step")
    return sorted(frame["step"].unique())


def _step_spans(timeline: pd.DataFrame) -> list[tuple[pd.DataFrame, float, float]]:
    """Each step's rows with the step's span: its earliest start to its latest end on any rank."""
    out = []
    for step in _steps(timeline):
        part = timeline if step is None else timeline[timeline["step"] == step]
        out.append((part, part.start.min(), part.end.max()))
    return out


def bubble_table(timeline: pd.DataFrame) -> pd.DataFrame:
    """Per rank: busy time, idle (bubble) time and bubble share of the step, from a timeline
    (columns rank, start, end). A step spans the earliest start to the latest end of any rank.

    A trace of several steps (its ``step`` column, as :meth:`Trainer.traces` writes it) is read
    step by step: ``busy`` and ``idle`` are sums over the steps, and the time between one step's
    end and the next one's start (the optimizer, the driver, a user between two cells) is no bubble.
    """
    require_columns(timeline, TIMELINE, what="bubble_table")
    require_rows(timeline, what="bubble_table")
    ranks = sorted(timeline["rank"].unique())
    busy = pd.Series(0.0, index=ranks)
    span = 0.0
    for part, t0, t1 in _step_spans(timeline):
        span += t1 - t0
        busy = busy.add((part.end - part.start).groupby(part["rank"]).sum(), fill_value=0.0)
    out = pd.DataFrame({"busy": busy, "idle": span - busy})
    out["bubble"] = out.idle / span if span > 0 else 0.0
    out.index.name = "rank"
    return out


def _idle_intervals(tl: pd.DataFrame, t0: float, t1: float) -> list[tuple[float, float]]:
    gaps, cursor = [], t0
    for start, end in sorted(zip(tl.start, tl.end)):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < t1:
        gaps.append((cursor, t1))
    return gaps


#: Above this many blocks a timeline merges each rank's back-to-back blocks into busy segments
#: (whatever their kind) beside the bubbles: thousands of labelled bars are unreadable and slow.
MAX_LABELLED_BLOCKS = 600


def _merge_contiguous(part: pd.DataFrame) -> pd.DataFrame:
    """Blocks merged where one ends exactly where the next on the same rank begins."""
    rows = []
    for r, g in part.sort_values(["rank", "start"]).groupby("rank"):
        cur = None
        for row in g.itertuples(index=False):
            if cur is not None and abs(row.start - cur["end"]) <= 1e-12 * max(1.0, abs(row.start)):
                cur["end"], cur["count"] = row.end, cur["count"] + 1
            else:
                if cur is not None:
                    rows.append(cur)
                cur = {"rank": r, "start": row.start, "end": row.end, "microbatch": row.microbatch,
                       "chunk": row.chunk, "count": 1}
        if cur is not None:
            rows.append(cur)
    return pd.DataFrame(rows, columns=["rank", "start", "end", "microbatch", "chunk", "count"])


def _timeline_traces(timeline: pd.DataFrame, *, row_offset: float = 0.0, name_suffix: str = "",
                     showlegend: bool = True, t0: Optional[float] = None) -> list[go.Bar]:
    """Bars per action kind; chunks after the first are hatched (``/``, ``x``, ...) so an
    interleaved or V schedule's model chunks can be told apart; large timelines are merged."""
    tl = timeline.copy()
    t0 = tl.start.min() if t0 is None else t0
    traces = []
    if len(tl) > MAX_LABELLED_BLOCKS:
        merged = _merge_contiguous(tl)
        traces.append(go.Bar(
            y=merged["rank"] + row_offset, x=merged.end - merged.start, base=merged.start - t0, orientation="h",
            name=f"compute ({len(tl)} actions, merged)" + name_suffix, marker=dict(color="#6F8FAF", line=dict(width=0)),
            showlegend=showlegend, legendgroup="merged", customdata=merged[["count"]].values,
            hovertemplate="%{customdata[0]} actions back to back<br>%{base:.4g} + %{x:.4g}<extra></extra>"))
    for kind in ("F", "B", "I", "W") if len(tl) <= MAX_LABELLED_BLOCKS else ():
        part = tl[tl.action == kind]
        if part.empty:
            continue
        label = part.microbatch.astype(str) + part.chunk.map(lambda c: f".{c}" if c else "")
        hatch = [CHUNK_PATTERNS[int(c) % len(CHUNK_PATTERNS)] for c in part.chunk]
        traces.append(go.Bar(
            y=part["rank"] + row_offset, x=part.end - part.start, base=part.start - t0, orientation="h",
            name=ACTION_NAMES[kind] + name_suffix,
            marker=dict(color=ACTION_COLORS[kind], line=dict(width=0.5, color="white"),
                        pattern=dict(shape=hatch, fgcolor="rgba(255,255,255,0.55)", size=6)), text=label,
            textposition="inside", insidetextanchor="middle", showlegend=showlegend, legendgroup=kind,
            customdata=part[["microbatch", "chunk"]].values,
            hovertemplate=f"{kind} mb %{{customdata[0]}} chunk %{{customdata[1]}}<br>%{{base:.4g}} + %{{x:.4g}}<extra></extra>"))
    gaps_y, gaps_x, gaps_base = [], [], []
    for step_rows, s0, s1 in _step_spans(tl):      # bubbles inside each step, none between steps
        for r in sorted(tl["rank"].unique()):
            for a, b in _idle_intervals(step_rows[step_rows["rank"] == r], s0, s1):
                gaps_y.append(r + row_offset)
                gaps_x.append(b - a)
                gaps_base.append(a - t0)
    traces.append(go.Bar(y=gaps_y, x=gaps_x, base=gaps_base, orientation="h", name="bubble" + name_suffix,
                         marker=dict(color=BUBBLE_COLOR), showlegend=showlegend, legendgroup="bubble",
                         hovertemplate="idle %{x:.4g}<extra></extra>"))
    return traces


def timeline_figure(timeline: pd.DataFrame, *, title: str = "Pipeline timeline", unit: str = "") -> go.Figure:
    """One row per rank: forward/backward/weight-gradient blocks labelled by microbatch (``mb.chunk``),
    idle time shaded as bubble, each rank's bubble share in its row label.

    ``timeline``: columns rank, action, microbatch, chunk, start, end (a simulation's
    ``SimResult.timeline`` or a measured trace's ``events``). A trace of several steps shows them
    all, with bubbles inside each step only (see :func:`bubble_table`).
    """
    require_columns(timeline, ACTIONS, what="timeline_figure")
    require_rows(timeline, what="timeline_figure")
    bubbles = bubble_table(timeline)
    fig = go.Figure(_timeline_traces(timeline))
    ranks = sorted(timeline["rank"].unique())
    steps = _steps(timeline)
    over = f", {len(steps)} steps" if len(steps) > 1 else ""
    fig.update_layout(
        title=f"{title} (bubble {bubbles.idle.sum() / (bubbles.busy.sum() + bubbles.idle.sum()):.1%}{over})",
        barmode="overlay", height=170 + 50 * len(ranks), plot_bgcolor="white", bargap=0.15,
        xaxis=dict(title=f"time{f' ({unit})' if unit else ''}", showgrid=True, gridcolor="#eee"),
        yaxis=dict(autorange="reversed", tickvals=ranks,
                   ticktext=[f"rank {r} ({bubbles.loc[r, 'bubble']:.0%} idle)" for r in ranks]),
        legend=dict(orientation="h", y=-0.25))
    return fig


def timeline_comparison(simulated: pd.DataFrame, measured: pd.DataFrame, *, ranks: Optional[Sequence[int]] = None,
                        title: str = "Simulated vs measured") -> go.Figure:
    """Simulated (top) and measured (bottom) timelines of the same schedule, both from time 0, row
    for row: pipeline rank (stage) ``r`` above the measured rank that ran stage ``r``.

    ``measured``: one step of a trace's ``events``. ``ranks``: the global ranks of one pipeline,
    stage by stage (``topology.groups("pp")[0]``), when the run had other axes (tp, cp, dp: its
    global ranks are not the pipeline ranks): the rows of other ranks are left out. Pass a
    simulation calibrated in seconds (``Costs`` from measured action times) for a shared scale.
    """
    require_columns(simulated, ACTIONS, what="timeline_comparison (simulated)")
    require_columns(measured, ACTIONS, what="timeline_comparison (measured)")
    require_rows(simulated, what="timeline_comparison (simulated)")
    require_rows(measured, what="timeline_comparison (measured)")
    steps = _steps(measured)
    if len(steps) > 1:
        raise ValueError(f"timeline_comparison: the measured timeline holds {len(steps)} steps ({steps[0]}.."
                         f"{steps[-1]}), the simulation one: pass one, e.g. events[events.step == {steps[-1]}]")
    stages = sorted(int(r) for r in simulated["rank"].unique())
    if ranks is not None:
        if isinstance(ranks, (AbstractSet, Mapping)):      # {0, 4, 8, 12} iterates 0, 8, 4, 12
            raise ValueError(f"timeline_comparison: ranks={ranks!r} is unordered; give one pipeline's global ranks "
                             f"as a list, stage by stage: topology.groups('pp')[0]")
        ranks = [int(r) for r in ranks]
        if len(ranks) != len(stages) or len(set(ranks)) != len(ranks):
            raise ValueError(f"timeline_comparison: ranks={ranks} must name one global rank per pipeline rank of "
                             f"the simulation ({len(stages)}), stage by stage: topology.groups('pp')[0]")
        measured = measured[measured["rank"].isin(ranks)]
        measured = measured.assign(rank=measured["rank"].map({r: i for i, r in enumerate(ranks)}))
    elif not set(int(r) for r in measured["rank"].unique()) <= set(stages):
        raise ValueError(f"timeline_comparison: the measured timeline has ranks "
                         f"{sorted(int(r) for r in measured['rank'].unique())}, the simulation pipeline ranks "
                         f"{stages}: pass ranks=topology.groups('pp')[0] (one pipeline's global ranks, stage by "
                         f"stage), or the measured rows would be drawn under the wrong stages")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=(f"simulated (bubble {_share(simulated):.1%})",
                                        f"measured (bubble {_share(measured):.1%})"))
    for tr in _timeline_traces(simulated):
        fig.add_trace(tr, row=1, col=1)
    for tr in _timeline_traces(measured, showlegend=False):
        fig.add_trace(tr, row=2, col=1)
    ranks = sorted(set(simulated["rank"]) | set(measured["rank"]))
    for row in (1, 2):
        fig.update_yaxes(autorange="reversed", tickvals=ranks, ticktext=[f"rank {r}" for r in ranks], row=row, col=1)
    fig.update_layout(title=title, barmode="overlay", height=220 + 90 * len(ranks), plot_bgcolor="white",
                      legend=dict(orientation="h", y=-0.12))
    fig.update_xaxes(title_text="time (s)", row=2, col=1)
    return fig


def _share(tl: pd.DataFrame) -> float:
    b = bubble_table(tl)
    return float(b.idle.sum() / (b.busy.sum() + b.idle.sum()))


# ------------------------------------------------------------------------------------------ memory
def memory_figure(memory: pd.DataFrame, *, estimate: Optional[pd.DataFrame] = None, t0: Optional[float] = None) -> go.Figure:
    """Memory per rank over time, stacked by category, with each rank's peak marked and, if given,
    the estimator's total (dashed).

    ``memory``: a memory trace (columns rank, time, parameters, gradients, optimizer, activations,
    activations_peak). ``estimate``: :func:`mlmkit.estimate.estimate_memory` (index rank).
    """
    require_columns(memory, MEMORY, what="memory_figure")
    require_rows(memory, what="memory_figure")
    ranks = sorted(memory["rank"].unique())
    cols = min(len(ranks), 4)
    rows = -(-len(ranks) // cols)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes=True, subplot_titles=[f"rank {r}" for r in ranks],
                        horizontal_spacing=0.03, vertical_spacing=0.12)
    t0 = memory.time.min() if t0 is None else t0
    mib = 2**20
    for i, r in enumerate(ranks):
        row, col = i // cols + 1, i % cols + 1
        m = memory[memory["rank"] == r].sort_values("time")
        t = m.time - t0
        for cat in ("parameters", "gradients", "optimizer", "activations"):
            fig.add_trace(go.Scatter(x=t, y=m[cat] / mib, stackgroup=f"r{r}", name=cat, legendgroup=cat,
                                     showlegend=(i == 0), line=dict(width=0.5, color=MEMORY_COLORS[cat]),
                                     hovertemplate=f"{cat} %{{y:.3f}} MiB<extra>rank {r}</extra>"), row=row, col=col)
        total = m.parameters + m.gradients + m.optimizer + m.activations_peak
        k = int(total.values.argmax())
        fig.add_trace(go.Scatter(x=[t.iloc[k]], y=[total.iloc[k] / mib], mode="markers+text", name="peak",
                                 legendgroup="peak", showlegend=(i == 0), marker=dict(symbol="triangle-down", size=10, color="black"),
                                 text=[f"peak {total.iloc[k] / mib:.2f} MiB"], textposition="bottom left"),
                      row=row, col=col)
        top = total.max() / mib
        if estimate is not None and r in estimate.index:
            est = float(estimate.loc[r, "total"]) / mib
            top = max(top, est)
            fig.add_trace(go.Scatter(x=[t.min(), t.max()], y=[est, est], mode="lines", name="estimate",
                                     legendgroup="estimate", showlegend=(i == 0),
                                     line=dict(dash="dash", color="black", width=1)), row=row, col=col)
        ymax = max(ymax, top) if i else top
        fig.update_xaxes(title_text="time (s)", row=row, col=col)
    # headroom above the highest peak so that its label stays clear of the subplot titles
    fig.update_yaxes(range=[0, ymax * 1.25], row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=1)
    fig.update_layout(title="Memory per rank (MiB)", height=280 * rows + 100, plot_bgcolor="white",
                      legend=dict(orientation="h", y=-0.22), margin=dict(t=90))
    return fig


def activation_peaks_figure(peaks: pd.DataFrame, *, title: str = "Peak activation memory per rank") -> go.Figure:
    """Grouped bars per variant and rank: measured peak activations (bars) and the estimator's
    (black marks), on a log axis so that small recomputed peaks stay visible beside large ones.

    ``peaks``: columns ``variant``, ``rank``, ``measured MiB``, ``estimated MiB``.
    """
    require_columns(peaks, PEAKS, what="activation_peaks_figure")
    require_rows(peaks, what="activation_peaks_figure", why="give one row per variant and rank")
    fig = go.Figure()
    ranks = sorted(peaks["rank"].unique())
    for k, r in enumerate(ranks):
        part = peaks[peaks["rank"] == r]
        fig.add_bar(x=part["variant"], y=part["measured MiB"], name=f"rank {r} measured", offsetgroup=str(r),
                    marker_color=RANK_COLORS[k % len(RANK_COLORS)], legendgroup=str(r))
        fig.add_trace(go.Scatter(x=part["variant"], y=part["estimated MiB"], mode="markers", name=f"rank {r} estimated",
                                 offsetgroup=str(r), legendgroup=str(r),
                                 marker=dict(symbol="line-ew-open", size=22, color="black", line=dict(width=3))))
    fig.update_layout(title=title, barmode="group", scattermode="group", yaxis_type="log",
                      yaxis_title="peak activations (MiB, log scale)", xaxis_title="variant",
                      legend_title_text="rank", plot_bgcolor="white")
    return fig


# ------------------------------------------------------------------------------------------ communication
def comm_matrix(comm: pd.DataFrame) -> pd.DataFrame:
    """Wire bytes from each rank (rows) to each rank (columns).

    A point-to-point send goes to its peer, an all-to-all row to its peer. A ring collective sends all of a rank's wire bytes to
    its successor in the ring (the group's next rank), which is how ring all-reduce, all-gather and
    reduce-scatter move data.
    """
    require_columns(comm, COMM, what="comm_matrix")
    rows = []
    for r in comm.itertuples(index=False):
        if not r.wire_bytes:
            continue
        ranks = list(r.ranks)
        if r.op in ("send", "all_to_all"):    # a message, or an all-to-all's part for one peer
            dst = ranks[1]
        elif len(ranks) > 1:
            dst = ranks[(ranks.index(r.rank) + 1) % len(ranks)]
        else:
            continue
        rows.append((r.rank, dst, r.wire_bytes))
    df = pd.DataFrame(rows, columns=["src", "dst", "bytes"])
    n = int(max(comm["rank"].max(), max((max(x) for x in comm.ranks), default=0))) + 1 if len(comm) else 0
    mat = df.pivot_table(index="src", columns="dst", values="bytes", aggfunc="sum", fill_value=0)
    return mat.reindex(index=range(n), columns=range(n), fill_value=0).astype("int64")


def comm_heatmap(comm: pd.DataFrame) -> go.Figure:
    """Rank-by-rank heatmap of wire bytes (see :func:`comm_matrix`)."""
    require_columns(comm, COMM, what="comm_heatmap")
    mat = comm_matrix(comm)
    steps = _steps(comm)
    fig = go.Figure(go.Heatmap(z=mat.values / 2**20, x=[f"to {c}" for c in mat.columns], y=[f"from {r}" for r in mat.index],
                               colorscale="Blues", colorbar=dict(title="MiB"),
                               hovertemplate="%{y} %{x}: %{z:.3f} MiB<extra></extra>"))
    over = f" in {len(steps)} steps" if len(steps) > 1 else ""
    fig.update_layout(title=f"Bytes sent between ranks{over}", yaxis=dict(autorange="reversed"),
                      height=160 + 40 * len(mat))
    return fig


def comm_by_axis_figure(comm: pd.DataFrame, *, estimate: Optional[pd.DataFrame] = None) -> go.Figure:
    """Wire bytes per rank and step, stacked by axis (tp, cp, pp, dp, embedding, world); the
    estimator's bytes per step (:func:`mlmkit.estimate.estimate_comm`) as markers.

    A trace of several steps (its ``step`` column) shows the mean step, so that it compares with the
    estimate of one step."""
    require_columns(comm, COMM, what="comm_by_axis_figure")
    steps = _steps(comm)
    table = comm.pivot_table(index="rank", columns="axis", values="wire_bytes", aggfunc="sum", fill_value=0)
    table = table / len(steps)
    fig = go.Figure()
    for axis in [a for a in AXIS_COLORS if a in table]:
        fig.add_trace(go.Bar(x=table.index, y=table[axis] / 2**20, name=axis, marker_color=AXIS_COLORS[axis]))
    if estimate is not None:
        fig.add_trace(go.Scatter(x=estimate.index, y=estimate.sum(axis=1) / 2**20, mode="markers", name="estimate",
                                 marker=dict(symbol="line-ew-open", size=28, color="black", line=dict(width=2))))
    over = f" (mean of {len(steps)} steps)" if len(steps) > 1 else ""
    fig.update_layout(title=f"Bytes sent per rank and step, by axis{over}", barmode="stack",
                      xaxis=dict(title="rank", dtick=1),
                      yaxis=dict(title="MiB"), plot_bgcolor="white")
    return fig


def comm_timeline_figure(comm: pd.DataFrame, *, t0: Optional[float] = None) -> go.Figure:
    """Collectives and messages on a timeline, one row per rank, coloured by axis."""
    require_columns(comm, COMM_TIMED, what="comm_timeline_figure")
    t0 = comm.start.min() if t0 is None else t0
    fig = go.Figure()
    for axis in [a for a in AXIS_COLORS if a in set(comm.axis)]:
        part = comm[comm.axis == axis]
        fig.add_trace(go.Bar(y=part["rank"], x=(part.end - part.start).clip(lower=1e-6), base=part.start - t0,
                             orientation="h", name=axis, marker_color=AXIS_COLORS[axis],
                             customdata=part[["op", "bytes", "site"]].values,
                             hovertemplate="%{customdata[0]} %{customdata[1]} B at %{customdata[2]}<extra></extra>"))
    ranks = sorted(comm["rank"].unique())
    fig.update_layout(title="Communication over time", barmode="overlay", plot_bgcolor="white",
                      yaxis=dict(autorange="reversed", tickvals=ranks, ticktext=[f"rank {r}" for r in ranks]),
                      xaxis=dict(title="time (s)"), height=120 + 40 * len(ranks))
    return fig


# ------------------------------------------------------------------------------------------ shards
def shard_figure(shards: pd.DataFrame) -> go.Figure:
    """A table of what each rank holds: parameter, local and global shape, split dimension, bytes."""
    require_columns(shards, (SHARDS[0] + ("bytes",), SHARDS[1]), what="shard_figure")
    require_rows(shards, what="shard_figure", why=f"expected {SHARDS[1]}")
    df = shards.copy()
    split = df.split_dim.map(lambda d: "replicated" if pd.isna(d) else f"dim {int(d)}")
    cols = ["rank", "name", "local_shape", "global_shape", "split", "bytes"]
    df["split"] = split
    values = [df[c].astype(str) if c != "bytes" else df[c].map(lambda b: f"{b:,}") for c in cols]
    fill = [["#eef3fb" if s == "replicated" else "white" for s in split]] * len(cols)
    fig = go.Figure(go.Table(header=dict(values=cols, fill_color="#4C78A8", font=dict(color="white")),
                             cells=dict(values=values, fill_color=fill, align="left")))
    # every row visible: header, title and one line per row (plotly's default cell is ~28 px)
    fig.update_layout(title="Parameter shards (blue rows: replicated on every TP rank)",
                      height=170 + 30 * len(df), margin=dict(t=60, b=10))
    return fig


def shard_matrix_figure(shards: pd.DataFrame) -> go.Figure:
    """The split matrices: each parameter at its global shape, cut into the blocks the tensor-parallel
    ranks hold (colour: rank), a replicated parameter as one block all ranks hold.

    ``shards``: :func:`mlmkit.model.shard_table` rows of every rank (e.g. ``cluster.run_frame``).
    """
    from plotly.subplots import make_subplots

    require_columns(shards, SHARDS, what="shard_matrix_figure")
    require_rows(shards, what="shard_matrix_figure", why=f"expected {SHARDS[1]}")
    names = list(dict.fromkeys(shards["name"]))
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.06)
    ranks = sorted(shards["rank"].unique())
    for i, name in enumerate(names, start=1):
        part = shards[shards["name"] == name].sort_values("rank")
        shape = tuple(part.global_shape.iloc[0])
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        split = part.split_dim.iloc[0]
        size = int(part.tp_size.iloc[0]) if "tp_size" in part else len(part)
        for _, r in part.iterrows():
            if pd.isna(split):
                x0, x1, y0, y1 = 0, cols, 0, rows
                label, color, opacity = "replicated", "#BAB0AC", 0.5
            else:
                k = int(r.tp_rank) if "tp_rank" in r else ranks.index(r["rank"])
                local = tuple(r.local_shape)
                if len(shape) == 1 or int(split) == 0 and len(shape) == 2:
                    n = local[0]
                    if len(shape) == 2:
                        x0, x1, y0, y1 = 0, cols, k * n, (k + 1) * n
                    else:
                        x0, x1, y0, y1 = k * n, (k + 1) * n, 0, 1
                else:
                    n = local[1]
                    x0, x1, y0, y1 = k * n, (k + 1) * n, 0, rows
                label, color, opacity = f"rank {r['rank']}: {local}", RANK_COLORS[k % len(RANK_COLORS)], 0.85
            fig.add_trace(go.Scatter(x=[x0, x1, x1, x0, x0], y=[y0, y0, y1, y1, y0], fill="toself", mode="lines",
                                     line=dict(color="white", width=2), fillcolor=color, opacity=opacity,
                                     name=label, hoveron="fills", hoverinfo="name", showlegend=False),
                          row=1, col=i)
            fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=label, showarrow=False,
                               font=dict(color="white" if label != "replicated" else "#333", size=11), row=1, col=i)
        fig.update_xaxes(title_text=f"columns ({cols})", range=[0, cols], showgrid=False, row=1, col=i)
        fig.update_yaxes(title_text=f"rows ({rows})", range=[rows, 0], showgrid=False, row=1, col=i)
    fig.update_layout(title=f"Split matrices over {len(ranks)} ranks (colour: the rank holding the block)",
                      height=380, plot_bgcolor="white")
    return fig
