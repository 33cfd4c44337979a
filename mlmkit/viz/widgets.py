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
        # The live widget, and for a static page (an exported report) its current state as HTML.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        fallback = self.summary.value + self.error_box.value
        if self.figure is not None:
            fallback += self.figure.to_html(full_html=False, include_plotlyjs=False)
        bundle["text/html"] = fallback
        return bundle


def schedule_explorer(**kwargs) -> ScheduleExplorer:
    """A :class:`ScheduleExplorer` (display it as a cell's last expression)."""
    return ScheduleExplorer(**kwargs)


class SessionControls:
    """Buttons bound to a :class:`~mlmkit.cluster.Session`: step an action, a microbatch, a whole
    step, or reset the step; the measured timeline and the per-rank state update after each click."""

    STATE_COLUMNS = ["pp", "tp", "dp", "step", "position", "actions", "next_action", "held_count", "activation_bytes"]

    def __init__(self, session):
        self.session = session
        self.action_button = W.Button(description="step action", icon="step-forward")
        self.microbatch_button = W.Button(description="microbatch", icon="fast-forward")
        self.step_button = W.Button(description="whole step", icon="forward")
        self.reset_button = W.Button(description="reset step", icon="undo")
        self.status = W.HTML()
        self.state_view = W.HTML()
        self.output = W.Output()
        self.figure = None
        self.state = None
        self.last: Optional[dict] = None
        self.error: Optional[str] = None
        self.action_button.on_click(lambda _b: self._do(self.session.step_action))
        self.microbatch_button.on_click(lambda _b: self._do(self.session.step_microbatch))
        self.step_button.on_click(lambda _b: self._do(self.session.step))
        self.reset_button.on_click(lambda _b: self._do(self.session.reset_step))
        self.widget = W.VBox([W.HBox([self.action_button, self.microbatch_button, self.step_button, self.reset_button]),
                              self.status, self.state_view, self.output])
        self.refresh()

    def _do(self, fn) -> None:
        try:
            out = fn()
            self.last = out if isinstance(out, dict) else None
            self.error = None
        except Exception as err:  # noqa: BLE001 - shown in the widget, the session has recovered
            self.error = f"{type(err).__name__}: {err}"
        self.refresh()

    def refresh(self) -> None:
        self.state = self.session.state()
        cols = [c for c in self.STATE_COLUMNS if c in self.state]
        self.state_view.value = self.state[cols].to_html()
        hist = self.session.metrics()
        msg = f"steps done: {len(hist)}" + (f", last loss {hist.loss.iloc[-1]:.4f}" if len(hist) else "")
        if self.error:
            msg += f"<br><span style='color:#b00'>{html.escape(self.error[:2000])}</span>"
        self.status.value = msg
        events = self.session.traces()["events"]
        if len(events):
            step_rows = events[events.start >= self._step_start(events)]
            self.figure = timeline_figure(step_rows, title="measured (current or last step)", unit="s")
        _show(self.output, self.figure)

    def _step_start(self, events) -> float:
        # The current (or last) step began at the latest first forward of microbatch 0 on rank 0.
        first = events[(events.action == "F") & (events.microbatch == 0) & (events.chunk == 0)]
        first = first[first["rank"] == first["rank"].min()]
        return float(first.start.max()) if len(first) else float(events.start.min())

    def _ipython_display_(self) -> None:
        display(self.widget)
