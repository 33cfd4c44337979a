"""Widgets: a schedule explorer that needs no cluster, and stepping controls bound to a Session.

Both keep their latest figure in ``.figure`` and state in plain attributes, so they can be driven
and checked from Python (``explorer.stages.value = 4``; ``controls.step_button.click()``).
"""

from __future__ import annotations

import html
from typing import Optional

import ipywidgets as W
from IPython.display import display

from mlmkit.pipeline import SCHEDULES, ScheduleError, make_schedule, simulate
from mlmkit.pipeline.schedule import V_SCHEDULES
from mlmkit.viz.figures import timeline_figure

__all__ = ["ScheduleExplorer", "SessionControls", "schedule_explorer"]


def _show(output: W.Output, fig) -> None:
    # Inside a notebook the Output widget captures the figure; in a plain Python process (tests,
    # scripts) there is nothing to render into, so only the figure object is kept.
    output.clear_output(wait=True)
    try:
        from IPython import get_ipython

        in_kernel = get_ipython() is not None and hasattr(get_ipython(), "kernel")
    except ImportError:
        in_kernel = False
    if in_kernel and fig is not None:
        with output:
            display(fig)


def _bundle(widget, html_text: str, figure, **kwargs) -> dict:
    """The live widget, and for a static page (an exported report) its state as HTML: ``html_text``
    and the figure (plotly.js comes from the page)."""
    bundle = widget._repr_mimebundle_(**kwargs)
    if figure is not None:
        html_text += figure.to_html(full_html=False, include_plotlyjs=False)
    bundle["text/html"] = html_text
    return bundle


class ScheduleExplorer:
    """Pick a schedule, p, m, v and the costs of F, B and W; see the timeline, bubble and peak in-flight.

    Costs are per rank and microbatch (the rank's whole share of the model): ``F`` the forward,
    ``B`` the backward's input-gradient part, ``W`` its weight-gradient part. A full backward
    costs ``B + W``; a split schedule (zb-h1, zb-v, dualpipev) runs them as separate I and W
    actions. With ``v`` chunks per rank each chunk costs ``1/v`` of them, so interleaving does
    the same work in more, smaller pieces. Everything is simulated on the driver (pure Python).
    """

    def __init__(self, *, schedule: str = "1f1b", stages: int = 4, microbatches: int = 8, chunks: int = 2,
                 forward: float = 1.0, backward: float = 1.0, weight: float = 1.0):
        style = {"description_width": "110px"}
        self.schedule = W.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule", style=style)
        self.stages = W.IntSlider(value=stages, min=1, max=8, description="stages p", style=style)
        self.microbatches = W.IntSlider(value=microbatches, min=1, max=32, description="microbatches m", style=style)
        self.chunks = W.IntSlider(value=chunks, min=2, max=4, description="chunks v", style=style)
        self.forward = W.FloatSlider(value=forward, min=0.1, max=4.0, step=0.1, description="cost F", style=style)
        self.backward = W.FloatSlider(value=backward, min=0.1, max=8.0, step=0.1, description="cost B (inputs)",
                                      style=style)
        self.weight = W.FloatSlider(value=weight, min=0.0, max=4.0, step=0.1, description="cost W (weights)",
                                    style=style)
        self.summary = W.HTML()
        self.error_box = W.HTML()
        self.output = W.Output()
        self.figure = None
        self.result = None
        self.error: Optional[str] = None
        for w in (self.schedule, self.stages, self.microbatches, self.chunks, self.forward, self.backward, self.weight):
            w.observe(lambda _change: self.update(), names="value")
        controls = W.VBox([self.schedule, self.stages, self.microbatches, self.chunks,
                           self.forward, self.backward, self.weight, self.error_box])
        self.widget = W.VBox([W.HBox([controls, self.summary]), self.output])
        self.update()

    def update(self) -> None:
        """Re-simulate with the current values and redraw."""
        name = self.schedule.value
        self.chunks.disabled = name != "interleaved-1f1b"
        chunks = self.chunks.value if name == "interleaved-1f1b" else (2 if name in V_SCHEDULES else 1)
        F, B, Wt = self.forward.value, self.backward.value, self.weight.value
        costs = {"forward": F / chunks, "backward": B / chunks, "weight": Wt / chunks}   # a chunk: its share
        values = (f"<p><b>{name}</b>, p={self.stages.value}, m={self.microbatches.value}"
                  + (f", v={chunks}" if chunks > 1 else "") + f"; per rank and microbatch F={F:g}, B={B:g}, W={Wt:g}</p>")
        try:
            sched = make_schedule(name, stages=self.stages.value, microbatches=self.microbatches.value, chunks=chunks)
            self.result = simulate(sched, costs)
            self.error = None
            self.error_box.value = ""
        except ScheduleError as err:
            self.result, self.error = None, str(err)
            self.summary.value = values
            self.error_box.value = f"<p style='color:#b00'><b>Not a valid schedule:</b> {html.escape(self.error)}</p>"
            self.output.clear_output()
            return
        r = self.result
        ideal = sched.microbatches * (F + B + Wt)
        peaks = ", ".join(f"r{k}: {v}" for k, v in r.peak_inflight.items())
        self.summary.value = (
            values
            + f"<p>step time <b>{r.step_time:.3g}</b> (no bubble: m x (F + B + W) = {ideal:.3g})<br>"
            f"bubble <b>{r.bubble_fraction:.1%}</b> of each rank's step: the step takes "
            f"<b>{r.step_time / ideal:.2f}x</b> the time without bubble<br>peak in-flight microbatches: {peaks}</p>"
            + "".join(f"<p><i>note: {html.escape(n)}</i></p>" for n in sched.notes))
        self.figure = timeline_figure(r.timeline, title=f"{name}: simulated")
        _show(self.output, self.figure)

    def _repr_mimebundle_(self, **kwargs):
        return _bundle(self.widget, self.summary.value + self.error_box.value, self.figure, **kwargs)


def schedule_explorer(**kwargs) -> ScheduleExplorer:
    """A :class:`ScheduleExplorer` (display it as a cell's last expression)."""
    return ScheduleExplorer(**kwargs)


class SessionControls:
    """Buttons bound to a :class:`~mlmkit.cluster.Session`: step an action, a microbatch, a whole
    step, or reset the step; the per-rank state (position, next action, held activations and their
    bytes) and the step's timeline update after each click.

    The timeline is in *logical* time, not wall-clock time (a student thinking between clicks is
    not a pipeline bubble): the schedule laid out with one slot per forward and two per backward,
    the actions already done on each pipeline rank in colour, those still to do in grey. Between
    steps it shows the next step's plan. Errors (a failed rank, a cluster that was shut down)
    appear in the widget, never only in a log.
    """

    STATE_COLUMNS = ["pp", "tp", "dp", "step", "position", "actions", "next_action", "held_count", "activation_bytes"]

    def __init__(self, session):
        self.session = session
        self.action_button = W.Button(description="step action", icon="step-forward")
        self.microbatch_button = W.Button(description="microbatch", icon="fast-forward")
        self.step_button = W.Button(description="whole step", icon="forward")
        self.reset_button = W.Button(description="reset step", icon="undo")
        self.buttons = [self.action_button, self.microbatch_button, self.step_button, self.reset_button]
        self.status = W.HTML()
        self.state_view = W.HTML()
        self.output = W.Output()
        self.figure = None
        self.state = None
        self.timeline = None
        self.last: Optional[dict] = None
        self.error: Optional[str] = None
        self.action_button.on_click(lambda _b: self._do(self.session.step_action))
        self.microbatch_button.on_click(lambda _b: self._do(self.session.step_microbatch))
        self.step_button.on_click(lambda _b: self._do(self.session.step))
        self.reset_button.on_click(lambda _b: self._do(self.session.reset_step))
        self.widget = W.VBox([W.HBox(self.buttons), self.status, self.state_view, self.output])
        self.refresh()

    def _do(self, fn) -> None:
        if not self._usable():
            return
        try:
            out = fn()
            self.last = out if isinstance(out, dict) else None
            self.error = None
        except Exception as err:  # noqa: BLE001 - shown in the widget, the session has recovered
            self.error = f"{type(err).__name__}: {err}"
        self.refresh()

    def _usable(self) -> bool:
        cluster = getattr(self.session, "cluster", None)
        gone = getattr(self.session, "closed", False) or (cluster is not None and not cluster.running)
        if gone:
            self.error = ("this session's cluster is shut down (or the session is closed): nothing can step. "
                          "Start a cluster and a new session, then new controls: SessionControls(cluster.session(config))")
            for b in self.buttons:
                b.disabled = True
            self.status.value = f"<span style='color:#b00'>{html.escape(self.error)}</span>"
        return not gone

    def refresh(self) -> None:
        if not self._usable():
            return
        try:
            self.state = self.session.state()
            hist = self.session.metrics()
        except Exception as err:  # noqa: BLE001 - e.g. the engines went away between clicks
            self.error = f"{type(err).__name__}: {err}"
            self.status.value = f"<span style='color:#b00'>{html.escape(self.error[:2000])}</span>"
            return
        cols = [c for c in self.STATE_COLUMNS if c in self.state]
        self.state_view.value = self.state[cols].to_html()
        msg = f"steps done: {len(hist)}" + (f", last loss {hist.loss.iloc[-1]:.4f}" if len(hist) else "")
        if self.error:
            msg += f"<br><span style='color:#b00'>{html.escape(self.error[:2000])}</span>"
        self.status.value = msg
        self.timeline = self.logical_timeline()
        in_step = bool(self.timeline.done.any() and not self.timeline.done.all())
        self.figure = _progress_figure(self.timeline, title=("this step, in logical time" if in_step
                                                             else "the next step's plan, in logical time"))
        _show(self.output, self.figure)

    def logical_timeline(self):
        """The session's schedule in slots (F 1, B 2, W 1), with ``done``: whether each pipeline
        rank has performed that action in the step in progress (all False between steps)."""
        sched = self.session.schedule
        costs = {"forward": 1.0, "backward": 2.0}
        if sched.split_backward:
            costs = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
        tl = simulate(sched, costs).timeline.sort_values(["rank", "start"]).reset_index(drop=True)
        in_step = getattr(self.session, "cursor", None) is not None
        done = {}
        if in_step:
            compute = ("F", "B", "I", "W")
            for _, row in self.state.iterrows():
                p, pos = int(row["pp"]), int(row["position"])
                n = sum(1 for a in sched.actions[p][:pos] if a.kind in compute)
                done[p] = min(done.get(p, n), n)
        order = tl.groupby("rank").cumcount()
        tl["done"] = [bool(i < done.get(int(r), 0)) for r, i in zip(tl["rank"], order)]
        return tl

    def _repr_mimebundle_(self, **kwargs):
        return _bundle(self.widget, self.status.value + self.state_view.value, self.figure, **kwargs)


def _progress_figure(timeline, *, title: str):
    """A timeline whose actions still to do (``done`` False) are greyed over."""
    import plotly.graph_objects as go

    fig = timeline_figure(timeline[["rank", "action", "microbatch", "chunk", "start", "end"]], title=title,
                          unit="slots")
    todo = timeline[~timeline.done]
    if len(todo):
        fig.add_trace(go.Bar(x=todo.end - todo.start, base=todo.start, y=todo["rank"], orientation="h",
                             marker=dict(color="rgba(225,225,225,0.92)", line=dict(color="#bbb", width=1)),
                             name="to do", hovertext=[f"{a} mb {m}" for a, m in zip(todo.action, todo.microbatch)],
                             hoverinfo="text"))
    return fig
