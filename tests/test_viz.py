"""Figures are functions of DataFrames: check each figure's data against its frame; widgets from Python."""

import re
import subprocess
import sys

import pandas as pd
import pytest

from mlmkit import Topology
from mlmkit.pipeline import make_schedule, simulate
from mlmkit.viz import (
    bubble_table,
    comm_by_axis_figure,
    comm_heatmap,
    comm_matrix,
    comm_timeline_figure,
    memory_figure,
    save_html,
    schedule_explorer,
    shard_figure,
    timeline_comparison,
    timeline_figure,
    topology_figure,
)


def _comm_frame():
    return pd.DataFrame([dict(rank=0, op="all_reduce", axis="tp", ranks=(0, 1), bytes=64, wire_bytes=64, start=0.0,
                              end=1.0, site="x", phase="forward")])


@pytest.mark.parametrize("figure,frame,needle", [
    # the frames a notebook holds side by side, handed to the wrong figure
    (timeline_figure, "comm", r"timeline_figure: the frame lacks 'action', 'microbatch', 'chunk' .* expected a "
                              r"timeline: simulate\(...\).timeline, or the 'events' of a trace"),
    (bubble_table, "memory", r"bubble_table: the frame lacks 'start', 'end'"),
    (comm_heatmap, "timeline", r"comm_heatmap: the frame lacks 'op', 'axis', 'ranks', 'wire_bytes' .* expected the "
                               r"'comm' frame of a trace"),
    (comm_by_axis_figure, "timeline", r"comm_by_axis_figure: the frame lacks 'op', 'axis'"),
    (comm_timeline_figure, "timeline", r"comm_timeline_figure: the frame lacks 'op', 'axis'"),
    (memory_figure, "comm", r"memory_figure: the frame lacks 'time', 'parameters', .* expected the 'memory' frame"),
    (comm_matrix, "list", r"comm_matrix: expected a pandas DataFrame \(the 'comm' frame of a trace .*got list"),
])
def test_a_figure_handed_another_frame_says_which(figure, frame, needle):
    # They failed with AttributeError 'start' or KeyError 'rank' from inside pandas and plotly.
    frames = {"comm": _comm_frame(), "timeline": simulate(make_schedule("1f1b", stages=2, microbatches=2),
                                                         {"forward": 1, "backward": 2}).timeline,
              "memory": pd.DataFrame(columns=["rank", "time", "parameters", "gradients", "optimizer", "activations",
                                              "activations_peak"]),
              "list": [1, 2]}
    with pytest.raises((ValueError, TypeError), match=needle):
        figure(frames[frame])
    with pytest.raises(ValueError, match=r"timeline_comparison \(measured\): the frame lacks"):
        timeline_comparison(frames["timeline"], frames["comm"])


def _frames():
    from mlmkit.trace import MOE_COLUMNS, RING_COLUMNS

    return {"comm": _comm_frame(), "timeline": simulate(make_schedule("1f1b", stages=2, microbatches=2),
                                                        {"forward": 1, "backward": 2}).timeline,
            "memory": pd.DataFrame(columns=["rank", "time", "action", "parameters", "gradients", "optimizer",
                                            "activations", "activations_peak"]),
            "moe (dense model)": pd.DataFrame(columns=list(MOE_COLUMNS)),
            "ring (cp=1)": pd.DataFrame(columns=list(RING_COLUMNS)),
            "metrics": pd.DataFrame({"step": [0], "loss": [5.0]}),
            "stages of timelines": {0: simulate(make_schedule("1f1b", stages=2, microbatches=2),
                                                {"forward": 1, "backward": 2}).timeline},
            "list": [1, 2]}


@pytest.mark.parametrize("figure,args,needle", [
    # the pictures of MoE, ZeRO, context parallelism and the planner, handed a frame of another kind
    ("expert_load_figure", ("comm",), r"expert_load_figure: the frame lacks 'routed', 'kept', 'dropped' .* "
                                      r"expected the 'moe' frame of a trace of a mixture-of-experts model"),
    ("expert_load_figure", ("moe (dense model)",), r"expert_load_figure: the moe frame has no rows: the traced "
                                                   r"model has no mixture-of-experts layer"),
    ("expert_load", ("metrics",), r"expert_load: the frame lacks 'rank', 'site'"),
    ("all_to_all_figure", ("memory",), r"all_to_all_figure: the frame lacks 'op', 'axis', 'ranks', 'wire_bytes'"),
    ("moe_training_figure", ("comm",), r"moe_training_figure: the frame lacks 'step', 'loss' .* expected training "
                                       r"metrics"),
    ("parameter_memory_figure", ("comm",), r"parameter_memory_figure: the frame lacks 'time', 'parameters', 'action'"),
    ("zero_bytes_frame", ("comm",), r"zero_bytes_frame: comms must map each ZeRO stage to its comm trace"),
    ("zero_bytes_frame", ("stages of timelines",), r"zero_bytes_frame \(stage 0\): the frame lacks 'axis', "
                                                   r"'wire_bytes'"),
    ("zero_bytes_figure", ("comm",), r"zero_bytes_figure: the frame lacks 'stage', 'measured'"),
    ("ring_timeline_figure", ("comm",), r"ring_timeline_figure: the frame lacks 'step', 'src', 'pairs' .* "
                                        r"expected the 'ring' frame of a trace of a cp > 1 run"),
    ("ring_timeline_figure", ("ring (cp=1)",), r"ring_timeline_figure: the ring frame has no rows"),
    ("cp_memory_figure", ("memory",), r"cp_memory_figure: the frame lacks 'cp', 'measured', 'estimated'"),
    ("plan_breakdown_figure", ("comm",), r"plan_breakdown_figure: the frame lacks 'tp', 'cp', 'pp', 'dp'.* "
                                         r"expected a plan: mlmkit.plan.plan"),
    ("plan_memory_figure", ("timeline",), r"plan_memory_figure: the frame lacks 'tp'"),
    ("plan_vs_measured_figure", ("list",), r"plan_vs_measured_figure: expected a pandas DataFrame"),
])
def test_the_other_figures_handed_another_frame_say_which(figure, args, needle):
    # They failed with KeyError 'routed', AttributeError 'tp' or 'step', or drew an empty picture.
    import mlmkit.viz as viz

    frames = _frames()
    kwargs = {"gpu_memory_bytes": 80e9} if figure == "plan_memory_figure" else {}
    with pytest.raises((ValueError, TypeError), match=needle):
        getattr(viz, figure)(*[frames[a] for a in args], **kwargs)
    with pytest.raises(ValueError, match=r"expert_load: column='dropped'; expected 'routed'"):
        viz.expert_load(_moe_trace(), column="dropped")
    with pytest.raises(ValueError, match=r"ring_timeline_figure \(comm\): the frame lacks 'op', 'axis'"):
        viz.ring_timeline_figure(pd.DataFrame({c: [0] for c in frames["ring (cp=1)"].columns}), frames["timeline"])


def test_every_figure_of_a_trace_handed_an_empty_or_foreign_frame_says_so():
    # A session with tracing=False, or traces cleared since the last step, gives frames without rows:
    # timeline_figure, timeline_comparison, memory_figure and parameter_memory_figure divided by zero,
    # and the shard and topology pictures took any frame and failed inside pandas. Every figure that
    # takes one frame is handed each kind of trace frame with no rows: a picture, or a ValueError
    # that says what is wrong; never another error.
    import inspect

    import mlmkit.viz as viz
    from mlmkit.trace import COMM_COLUMNS, EVENT_COLUMNS, MOE_COLUMNS, RING_COLUMNS
    from mlmkit.trace.memory import MEMORY_COLUMNS

    kinds = {"events": EVENT_COLUMNS, "comm": COMM_COLUMNS, "moe": MOE_COLUMNS, "ring": RING_COLUMNS,
             "memory": MEMORY_COLUMNS, "topology": ("rank", "tp", "cp", "dp", "pp"),
             "shards": ("rank", "name", "local_shape", "global_shape", "split_dim", "bytes")}
    takes_one_frame = [n for n in viz.__all__ if inspect.isfunction(getattr(viz, n))
                       and n not in ("save_html", "schedule_explorer", "cp_split_figure", "cp_work_frame",
                                     "zero_bytes_frame", "plan_memory_figure", "timeline_comparison")]
    assert {"timeline_figure", "memory_figure", "parameter_memory_figure", "shard_figure", "topology_figure",
            "bubble_table", "comm_by_axis_figure", "ring_timeline_figure", "expert_load_figure"} <= set(takes_one_frame)
    said = 0
    for name in takes_one_frame:
        for kind, columns in kinds.items():
            try:
                getattr(viz, name)(pd.DataFrame(columns=list(columns)))
            except ValueError as err:
                said += 1
                assert f"{name}" in str(err) and ("no rows" in str(err) or "lacks" in str(err)), (name, kind, err)
    assert said > 40
    for figure in ("timeline_figure", "memory_figure", "parameter_memory_figure"):
        kind = "events" if figure == "timeline_figure" else "memory"
        with pytest.raises(ValueError, match=rf"{figure}: the frame has no rows: nothing was recorded"):
            getattr(viz, figure)(pd.DataFrame(columns=list(kinds[kind])))
    with pytest.raises(ValueError, match=r"shard_figure: the frame has no rows: expected parameter shards"):
        viz.shard_figure(pd.DataFrame(columns=list(kinds["shards"])))
    with pytest.raises(ValueError, match=r"topology_figure: the frame lacks 'tp', 'dp', 'pp' .* expected a rank grid"):
        viz.topology_figure(pd.DataFrame(columns=list(kinds["events"])))
    ev = pd.DataFrame(columns=list(EVENT_COLUMNS))
    with pytest.raises(ValueError, match=r"timeline_comparison \(measured\): the frame has no rows"):
        timeline_comparison(simulate(make_schedule("1f1b", stages=2, microbatches=2), {"forward": 1, "backward": 2}).timeline, ev)


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_timeline_blocks_and_bubble_share(name, chunks):
    res = simulate(make_schedule(name, stages=4, microbatches=8, chunks=chunks),
                   {"forward": 1.0, "backward": 2.0, "weight": 1.0})
    fig = timeline_figure(res.timeline)
    blocks = [t for t in fig.data if t.name in ("forward", "backward", "backward (inputs)", "weight grad")]
    assert sum(len(t.x) for t in blocks) == len(res.timeline)       # one block per action
    bubble = next(t for t in fig.data if t.name == "bubble")
    shaded = pd.Series(list(bubble.x)).groupby(list(bubble.y)).sum()
    for r in range(4):
        assert shaded[r] / res.step_time == pytest.approx(res.bubble_per_rank[r], abs=1e-12)
    assert f"{res.bubble_fraction:.1%}" in fig.layout.title.text
    assert bubble_table(res.timeline).bubble.to_dict() == pytest.approx(res.bubble_per_rank)


def test_a_trace_of_several_steps_has_bubbles_inside_each_step_only():
    # A session's trace kept over two steps, with 100 s between them (a user between two cells):
    # that wait is no pipeline bubble. Each step reads as the step alone; frames without a step
    # column (a simulation) are one step, as before.
    one = simulate(make_schedule("1f1b", stages=4, microbatches=8), {"forward": 1.0, "backward": 2.0}).timeline
    later = one.assign(start=one.start + one.end.max() + 100.0, end=one.end + one.end.max() + 100.0)
    two = pd.concat([one.assign(step=0), later.assign(step=1)], ignore_index=True)
    single = bubble_table(one)
    both = bubble_table(two)
    assert both.busy.to_dict() == pytest.approx((2 * single.busy).to_dict())
    assert both.idle.to_dict() == pytest.approx((2 * single.idle).to_dict())
    assert both.bubble.to_dict() == pytest.approx(single.bubble.to_dict())
    fig = timeline_figure(two)
    bubble = next(t for t in fig.data if t.name == "bubble")
    shaded = pd.Series(list(bubble.x)).groupby(list(bubble.y)).sum()
    assert shaded.to_dict() == pytest.approx((2 * single.idle).to_dict())
    assert max(b + x for b, x in zip(bubble.base, bubble.x)) == pytest.approx(two.end.max() - two.start.min())
    assert all(not (one.end.max() < b < later.start.min()) for b in bubble.base)   # nothing in the gap
    assert f"bubble {single.idle.sum() / (single.busy.sum() + single.idle.sum()):.1%}, 2 steps" in fig.layout.title.text
    with pytest.raises(ValueError, match=r"'step' column has 64 empty value\(s\) among 128 rows"):
        bubble_table(pd.concat([one, later.assign(step=1)], ignore_index=True))
    # A step in which a rank ran nothing is idle for that rank throughout.
    lonely = pd.concat([two, one.iloc[:1].assign(rank=9, step=0)], ignore_index=True)
    assert bubble_table(lonely).loc[9, "idle"] == pytest.approx(2 * one.end.max() - 1.0)


def test_timeline_comparison_has_both_panels():
    s = make_schedule("1f1b", stages=2, microbatches=4)
    sim = simulate(s, {"forward": 0.01, "backward": 0.02}).timeline
    measured = sim.assign(start=sim.start * 1.1 + 5.0, end=sim.end * 1.1 + 5.0)  # shifted clock
    fig = timeline_comparison(sim, measured)
    assert len([t for t in fig.data if t.name == "forward"]) == 2
    assert min(min(t.base) for t in fig.data if t.name == "forward") == pytest.approx(0.0)


def test_timeline_comparison_puts_each_stage_under_its_own_stage():
    # A tp=2 x pp=2 run: pipeline 0 is global ranks 0 and 2 (rank 1 is rank 0's tp peer). Drawn by
    # global rank, stage 1's simulation sat above rank 1's measurement (stage 0 again), with no word.
    sim = simulate(make_schedule("1f1b", stages=2, microbatches=4), {"forward": 1.0, "backward": 2.0}).timeline
    stage_of = {0: 0, 1: 0, 2: 1, 3: 1}
    measured = pd.concat([sim[sim["rank"] == stage_of[g]].assign(rank=g) for g in range(4)], ignore_index=True)
    measured = measured.assign(start=measured.start + 7.0, end=measured.end + 7.0, step=3)
    with pytest.raises(ValueError, match=r"the measured timeline has ranks \[0, 1, 2, 3\], the simulation pipeline "
                                         r"ranks \[0, 1\]: pass ranks=topology.groups\('pp'\)\[0\]"):
        timeline_comparison(sim, measured)
    fig = timeline_comparison(sim, measured, ranks=[0, 2])
    panels = [[t for t in fig.data if t.name == "backward" and t.yaxis == axis][0] for axis in ("y", "y2")]
    for r in (0, 1):          # each stage's backward blocks: the same offsets from time 0, above and below
        above = sorted(b for b, y in zip(panels[0].base, panels[0].y) if y == r)
        below = sorted(b for b, y in zip(panels[1].base, panels[1].y) if y == r)
        assert above == pytest.approx(below) and len(above) == 4
    with pytest.raises(ValueError, match=r"ranks=\[0\] must name one global rank per pipeline rank"):
        timeline_comparison(sim, measured, ranks=[0])
    with pytest.raises(ValueError, match=r"ranks=\{0, 2\} is unordered; give one pipeline's global ranks as a list"):
        timeline_comparison(sim, measured, ranks={0, 2})
    two = pd.concat([measured, measured.assign(step=4)], ignore_index=True)
    with pytest.raises(ValueError, match=r"holds 2 steps \(3..4\), the simulation one: pass one"):
        timeline_comparison(sim, two, ranks=[0, 2])


def _memory_frame():
    rows = []
    for r in range(2):
        for i, act in enumerate([0, 100, 250, 100, 0]):
            rows.append({"rank": r, "time": float(i), "action": "F", "microbatch": 0, "chunk": 0,
                         "parameters": 1000, "gradients": 1000 if i > 2 else 0, "optimizer": 2000,
                         "activations": act * (r + 1), "activations_peak": act * (r + 1) + 10})
    return pd.DataFrame(rows)


def test_memory_figure_stacks_categories_and_marks_peak():
    mem = _memory_frame()
    est = pd.DataFrame({"total": [5000, 6000]}, index=pd.Index([0, 1], name="rank"))
    fig = memory_figure(mem, estimate=est)
    stacked = [t for t in fig.data if t.stackgroup]
    assert len(stacked) == 4 * 2
    peaks = [t for t in fig.data if t.name == "peak"]
    for r, t in enumerate(peaks):
        m = mem[mem["rank"] == r]
        assert t.y[0] * 2**20 == pytest.approx((m.parameters + m.gradients + m.optimizer + m.activations_peak).max())
    assert [t.y[0] * 2**20 for t in fig.data if t.name == "estimate"] == pytest.approx([5000, 6000])


def _comm_frame():
    return pd.DataFrame([
        (0, "all_reduce", "tp", (0, 1), 400, 400, 0.0, 0.1, "x", "forward"),
        (1, "all_reduce", "tp", (0, 1), 400, 400, 0.0, 0.1, "x", "forward"),
        (0, "send", "pp", (0, 2), 128, 128, 0.2, 0.3, "p", "forward"),
        (2, "recv", "pp", (2, 0), 128, 0, 0.2, 0.3, "p", "forward"),
    ], columns=["rank", "op", "axis", "ranks", "bytes", "wire_bytes", "start", "end", "site", "phase"])


def test_comm_figures():
    comm = _comm_frame()
    mat = comm_matrix(comm)
    assert mat.loc[0, 1] == 400 and mat.loc[1, 0] == 400 and mat.loc[0, 2] == 128
    assert mat.values.sum() == comm.wire_bytes.sum()
    heat = comm_heatmap(comm)
    assert heat.data[0].z.sum() * 2**20 == pytest.approx(928)
    by_axis = comm_by_axis_figure(comm)
    assert {t.name for t in by_axis.data} == {"tp", "pp"}
    assert len(comm_timeline_figure(comm).data) == 2


def test_comm_by_axis_shows_one_step_of_a_trace_of_several():
    # The estimate is one step's bytes: a trace of three steps is drawn as its mean step (the bars
    # were three times the estimate's markers); the heatmap's totals say how many steps they hold.
    comm = _comm_frame()
    three = pd.concat([comm.assign(step=k) for k in range(3)], ignore_index=True)
    estimate = pd.DataFrame({"tp": [400, 400, 0], "pp": [128, 0, 0]}, index=pd.Index([0, 1, 2], name="rank"))
    for frame, title in ((comm, "by axis"), (three, "by axis (mean of 3 steps)")):
        fig = comm_by_axis_figure(frame, estimate=estimate)
        bars = {t.name: list(t.y) for t in fig.data if t.name in ("tp", "pp")}
        assert bars["tp"] == pytest.approx([400 / 2**20, 400 / 2**20, 0]) and bars["pp"][0] == pytest.approx(128 / 2**20)
        assert fig.layout.title.text.endswith(title)
    assert comm_heatmap(three).layout.title.text == "Bytes sent between ranks in 3 steps"


def test_topology_figure_colours_groups():
    topo = Topology(tp=2, pp=2, dp=2)
    fig = topology_figure(topo.to_frame())
    assert len(fig.data) == 3 and all(len(t.x) == 8 for t in fig.data)
    by_axis = {t.name.split()[0]: list(t.marker.color) for t in fig.data}
    for axis in ("tp", "dp", "pp"):
        for group in topo.groups(axis):
            assert len({by_axis[axis][r] for r in group}) == 1     # one colour per group
        assert len(set(by_axis[axis])) == len(topo.groups(axis))
    assert [t.visible for t in fig.data] == [False, False, True]


def test_shard_figure_lists_every_parameter():
    shards = pd.DataFrame({"rank": [0, 0], "name": ["a", "b"], "local_shape": [(2, 3), (3,)],
                           "global_shape": [(4, 3), (3,)], "split_dim": pd.array([0, None], dtype="Int64"),
                           "bytes": [24, 12]})
    fig = shard_figure(shards)
    assert list(fig.data[0].cells.values[1]) == ["a", "b"]
    assert list(fig.data[0].cells.values[4]) == ["dim 0", "replicated"]


def test_schedule_explorer_from_python():
    ex = schedule_explorer(schedule="1f1b", stages=4, microbatches=8)
    assert ex.result.bubble_fraction == pytest.approx(3 / 11)
    ex.schedule.value = "interleaved-1f1b"
    ex.chunks.value = 2
    assert ex.result.schedule.chunks == 2
    assert ex.result.bubble_ratio == pytest.approx(3 / 16)
    assert "bubble" in ex.summary.value and ex.figure is not None
    ex.schedule.value = "zb-h1"
    ex.weight.value = 1.0
    ex.backward.value = 1.0
    assert ex.result.schedule.split_backward
    ex.microbatches.value = 2                    # fewer than stages: runs, with a note
    assert ex.result is not None and "bubble is large" in ex.summary.value
    ex.schedule.value = "interleaved-1f1b"       # interleaving refuses it: shown below the controls, not raised
    assert ex.result is None and "too few microbatches" in ex.error
    assert "Not a valid schedule" in ex.error_box.value and "m=2" in ex.summary.value   # the values stay visible


def test_explorer_charges_each_chunk_its_share_and_splits_backward():
    ex = schedule_explorer(schedule="1f1b", stages=4, microbatches=8)
    plain = ex.result.step_time
    assert plain == pytest.approx((8 + 3) * 3.0)           # F + B + W = 3 per microbatch, (m + p - 1) slots
    ex.schedule.value = "interleaved-1f1b"
    ex.chunks.value = 2
    assert ex.result.step_time < plain                      # the same work, a smaller bubble
    ex.schedule.value = "zb-h1"
    assert ex.result.bubble_fraction < 3 / 11               # W fills the bubble with the default costs
    assert "1.00x" not in ex.summary.value and "the time without bubble" in ex.summary.value


def test_save_html_is_standalone(tmp_path):
    fig = timeline_figure(simulate(make_schedule("gpipe", stages=2, microbatches=2), {"forward": 1}).timeline)
    path = save_html(fig, str(tmp_path / "t.html"))
    text = open(path).read()
    assert "plotly" in text and len(text) > 1_000_000   # plotly.js embedded: opens offline


def test_viz_imports_no_torch():
    code = "import sys, mlmkit.viz; bad=[m for m in sys.modules if m.startswith('torch')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_topology_figure_with_context_parallelism():
    topo = Topology(tp=2, cp=2, dp=2)
    fig = topology_figure(topo.to_frame(), color_by="dp-cp")
    names = [t.name.split()[0] for t in fig.data]
    assert names == ["tp", "cp", "dp", "dp-cp", "pp"]
    colours = {n: list(t.marker.color) for n, t in zip(names, fig.data)}
    for kind in ("cp", "dp-cp"):
        for group in topo.groups(kind):
            assert len({colours[kind][r] for r in group}) == 1
        assert len(set(colours[kind])) == len(topo.groups(kind))
    assert [t.visible for t in fig.data] == [False, False, False, True, False]
    with pytest.raises(ValueError, match="color_by='ep'"):
        topology_figure(topo.to_frame(), color_by="ep")


@pytest.mark.parametrize("split", ["balanced", "naive"])
def test_cp_split_figure_colours_every_causal_pair_once(split):
    import math

    from mlmkit.context_parallel import attention_work
    from mlmkit.viz import cp_split_figure

    fig = cp_split_figure(16, 4, split)
    owner = fig.data[0].z[0]
    steps = [t.z for t in fig.data[1:]]
    assert len(steps) == 4
    seen = {}
    for z in steps:
        for q in range(16):
            for k in range(16):
                if not math.isnan(z[q][k]):
                    assert (q, k) not in seen and k <= q          # each causal pair computed once
                    seen[q, k] = int(z[q][k])
                    assert owner[q] == z[q][k]                    # by the rank holding the query
    assert len(seen) == 16 * 17 // 2
    per_rank = [sum(1 for r in seen.values() if r == rank) for rank in range(4)]
    assert per_rank == attention_work(16, 4, split)


def test_ring_timeline_and_memory_figures():
    from mlmkit.context_parallel import simulate_ring
    from mlmkit.viz import cp_memory_figure, ring_timeline_figure

    ring = pd.DataFrame(simulate_ring(16, 2, layers=2, pair_time=1.0)).assign(phase="forward", site="layers.0.attn.ring")
    comm = pd.DataFrame({"rank": [0, 1], "op": ["send", "send"], "axis": ["cp", "cp"], "start": [0.0, 0.0],
                         "end": [1.0, 1.0], "site": ["x", "x"], "bytes": [8, 8]})
    fig = ring_timeline_figure(ring, comm)
    assert len(fig.data[0].x) == len(ring) and len(fig.data[1].x) == 2
    mem = cp_memory_figure(pd.DataFrame({"cp": [1, 2, 4], "measured": [8.0, 4.2, 2.1], "estimated": [8.0, 4.2, 2.1]}))
    assert list(mem.data[2].y) == pytest.approx([8 / 1024, 4 / 1024, 2 / 1024])


# ------------------------------------------------------------------------------- mixture of experts
def _moe_trace():
    # Two ranks, two MoE layers, two calls each; 4 experts; rank 1 of layer 1 dropped 3 assignments.
    rows = []
    for rank in (0, 1):
        for layer in (0, 1):
            for call in (0, 1):
                routed = [1 + rank, 2, 3 + layer, 2 + call]
                kept = [min(n, 3) for n in routed]
                rows.append({"rank": rank, "site": f"layers.{layer}.mlp", "call": call, "routed": routed,
                             "kept": kept, "received": routed, "dropped": sum(routed) - sum(kept),
                             "aux_loss": 0.0, "z_loss": 0.0})
    return pd.DataFrame(rows)


def test_expert_load_figure_sums_the_trace_and_draws_the_even_line():
    from mlmkit.viz import expert_load, expert_load_figure

    moe = _moe_trace()
    load = expert_load(moe)
    assert load.loc[("layers.1.mlp", 1)].tolist() == [2 * 2, 2 * 2, 2 * 4, 2 + 3]   # summed over the calls
    fig = expert_load_figure(moe)
    heat, bars, even = fig.data
    assert [list(r) for r in heat.z] == load.values.tolist() and len(heat.y) == 4
    assert list(bars.y) == load.sum(axis=0).tolist()
    assert set(even.y) == {load.values.sum() / 4}
    assert f"{int(moe.dropped.sum())} assignments dropped" in fig.layout.title.text and moe.dropped.sum() > 0
    kept = expert_load(moe, column="kept")
    assert (kept.values <= 3 * 2).all() and kept.values.sum() < load.values.sum()


def test_all_to_all_figure_is_the_ep_traffic_only():
    from mlmkit.viz import all_to_all_figure

    def row(rank, op, axis, ranks, wire):
        return {"rank": rank, "op": op, "axis": axis, "ranks": ranks, "bytes": wire, "wire_bytes": wire,
                "start": 0.0, "end": 1.0, "site": "x", "phase": "forward"}

    comm = pd.DataFrame([row(0, "all_to_all", "ep", (0, 1), 2048), row(0, "all_to_all", "ep", (0, 2), 1024),
                         row(1, "all_to_all", "ep", (1, 0), 4096), row(2, "all_to_all", "ep", (2, 1), 512),
                         row(0, "all_reduce", "dp", (0, 1, 2), 10**6)])
    heat = all_to_all_figure(comm).data[0]
    z = [list(r) for r in heat.z]
    assert z == [[0, 2, 1], [4, 0, 0], [0, 0.5, 0]]          # KiB from row to column; the dp all-reduce left out


def test_moe_training_figure_shows_the_balance_loss():
    from mlmkit.viz import moe_training_figure

    metrics = pd.DataFrame({"step": [0, 1, 2], "loss": [5.0, 4.0, 3.5], "aux_loss": [0.02, 0.015, 0.011]})
    fig = moe_training_figure(metrics)
    assert [list(t.y) for t in fig.data] == [[5.0, 4.0, 3.5], [0.02, 0.015, 0.011]]
    assert len(moe_training_figure(metrics.drop(columns="aux_loss")).data) == 1


# ------------------------------------------------------------------------------- ZeRO
def test_parameter_memory_figure_follows_the_trace():
    from mlmkit.viz import parameter_memory_figure

    memory = pd.DataFrame({"rank": [0, 0, 0, 1, 1, 1], "time": [0.0, 0.001, 0.002, 0.0, 0.001, 0.002],
                           "action": ["gather a", "gather b", "F", "gather a", "gather b", "F"],
                           "parameters": [100, 300, 50, 100, 300, 50]})
    estimate = pd.DataFrame({"parameters": [300, 300]}, index=[0, 1])
    fig = parameter_memory_figure(memory, estimate=estimate)
    lines = [t for t in fig.data if t.name == "parameters"]
    assert [list(t.y) for t in lines] == [[100 / 1024, 300 / 1024, 50 / 1024]] * 2
    assert all(set(t.y) == {300 / 1024} for t in fig.data if t.name == "estimated peak")


def test_zero_bytes_frame_and_figure():
    from mlmkit.viz import zero_bytes_figure, zero_bytes_frame

    def comm(nbytes):
        return pd.DataFrame({"rank": [0, 0, 1], "axis": ["dp", "tp", "dp"], "wire_bytes": [nbytes, 999, nbytes]})

    est = {s: pd.DataFrame({"dp": [n, n]}, index=[0, 1]) for s, n in ((0, 200), (3, 300))}
    frame = zero_bytes_frame({0: comm(200), 3: comm(300)}, estimates=est)
    assert list(frame.measured) == [200, 200, 300, 300] and list(frame.estimated) == [200, 200, 300, 300]
    assert list(frame["vs zero 0"]) == [1.0, 1.0, 1.5, 1.5]
    fig = zero_bytes_figure(frame)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["zero 0", "zero 3"] and list(bars[1].y) == [300 / 1024] * 2


def test_plan_figures_stack_the_predicted_parts():
    from mlmkit.model import GPTConfig
    from mlmkit.plan import plan
    from mlmkit.viz import plan_breakdown_figure, plan_memory_figure
    from mlmkit.viz.plan import PLAN_PARTS

    table = plan(GPTConfig(vocab_size=51200, seq_len=2048, hidden=4096, heads=32, layers=32), gpus=64,
                 gpu="h100-sxm", global_batch_size=256, top=5)
    fig = plan_breakdown_figure(table)
    total = sum(pd.Series(list(t.x)) for t in fig.data)
    parts = table[list(PLAN_PARTS)].sum(axis=1).reset_index(drop=True)
    assert (total - parts).abs().max() < 1e-9
    assert ((parts - table.step_time_s.reset_index(drop=True)).abs() <= 1e-6 * table.step_time_s.max() + 1e-9).all()
    mem = plan_memory_figure(table, gpu_memory_bytes=80 * 2**30)
    stacked = sum(pd.Series(list(t.x)) for t in mem.data)
    assert (stacked * 2**30 - table.memory_per_gpu_bytes.reset_index(drop=True)).abs().max() < 1


def test_plan_vs_measured_figure_shows_both_and_the_ratio():
    from mlmkit.viz import plan_vs_measured_figure

    frame = pd.DataFrame({"predicted_s": [0.04, 0.45], "measured_s": [0.05, 0.40]}, index=["pp2 dp2", "tp4"])
    fig = plan_vs_measured_figure(frame)
    predicted, measured = fig.data
    assert list(predicted.x) == ["pp2 dp2", "tp4"] and list(predicted.y) == pytest.approx([40.0, 450.0])
    assert list(measured.y) == pytest.approx([50.0, 400.0]) and list(predicted.text) == ["0.80x", "1.12x"]
    assert fig.layout.yaxis.type == "log"


def test_static_report_shows_widget_fallbacks_loads_nothing_and_has_a_title():
    import nbformat

    from mlmkit.demo import static_report
    from mlmkit.viz import schedule_explorer

    ex = schedule_explorer(schedule="1f1b", stages=2, microbatches=4)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "bubble" in bundle["text/html"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("explorer")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={k: v for k, v in bundle.items()})]
    html = static_report(nb, title="my report")
    assert "<title>my report</title>" in html
    assert "bubble" in html and "widget-view" not in html
    assert not re.search(r"<script[^>]*src=[\"']https?://", html)


def test_timeline_hatches_chunks_and_merges_large_schedules():
    from mlmkit.pipeline import make_schedule, simulate
    from mlmkit.viz import timeline_figure

    tl = simulate(make_schedule("interleaved-1f1b", stages=4, microbatches=8, chunks=2), {"forward": 1, "backward": 2}).timeline
    fig = timeline_figure(tl)
    fwd = next(t for t in fig.data if t.name == "forward")
    chunks = [int(c) for _, c in fwd.customdata]
    assert [s for s in fwd.marker.pattern.shape] == ["" if c == 0 else "/" for c in chunks] and set(chunks) == {0, 1}
    big = simulate(make_schedule("interleaved-1f1b", stages=8, microbatches=64, chunks=2),
                   {"forward": 1, "backward": 2}).timeline                        # 2048 actions
    fig = timeline_figure(big)
    merged = next(t for t in fig.data if "merged" in t.name)
    assert len(merged.x) < 100 and sum(merged.x) == pytest.approx((big.end - big.start).sum())
    assert not any(t.name in ("forward", "backward") for t in fig.data)


def test_shard_pictures_show_every_row_and_the_split_blocks():
    from mlmkit.viz import shard_figure, shard_matrix_figure

    rows = []
    for rank in (0, 1):
        rows += [dict(rank=rank, name="fc1.weight", local_shape=(128, 64), global_shape=(256, 64), split_dim=0, tp_rank=rank,
                      tp_size=2, bytes=128 * 64 * 4),
                 dict(rank=rank, name="fc1.bias", local_shape=(128,), global_shape=(256,), split_dim=0, tp_rank=rank,
                      tp_size=2, bytes=512),
                 dict(rank=rank, name="fc2.weight", local_shape=(64, 128), global_shape=(64, 256), split_dim=1,
                      tp_rank=rank, tp_size=2, bytes=128 * 64 * 4),
                 dict(rank=rank, name="fc2.bias", local_shape=(64,), global_shape=(64,), split_dim=None, tp_rank=rank,
                      tp_size=2, bytes=256)]
    shards = pd.DataFrame(rows)
    shards["split_dim"] = shards["split_dim"].astype("Int64")
    table = shard_figure(shards)
    assert table.layout.height >= 170 + 28 * len(shards)              # all 8 rows fit (it used to hide 3)
    fig = shard_matrix_figure(shards)
    blocks = {(t.name, tuple(t.x), tuple(t.y)) for t in fig.data}
    assert ("rank 0: (128, 64)", (0, 64, 64, 0, 0), (0, 0, 128, 128, 0)) in blocks      # fc1: row blocks
    assert ("rank 1: (64, 128)", (128, 256, 256, 128, 128), (0, 0, 64, 64, 0)) in blocks  # fc2: column blocks
    assert sum(t.name == "replicated" for t in fig.data) == 2                           # fc2.bias on both ranks


def test_activation_peaks_figure_shows_estimates_on_a_log_axis_with_units():
    from mlmkit.viz import activation_peaks_figure

    peaks = pd.DataFrame({"variant": ["1f1b", "1f1b", "full recompute", "full recompute"], "rank": [0, 1, 0, 1],
                          "measured MiB": [2.0, 1.0, 0.05, 0.03], "estimated MiB": [2.1, 1.0, 0.05, 0.03]})
    fig = activation_peaks_figure(peaks)
    assert fig.layout.yaxis.type == "log" and "MiB" in fig.layout.yaxis.title.text
    assert fig.layout.legend.title.text == "rank"                        # not plotly express's "color"
    names = [t.name for t in fig.data]
    assert "rank 0 measured" in names and "rank 1 estimated" in names
    est = next(t for t in fig.data if t.name == "rank 0 estimated")
    assert list(est.y) == [2.1, 0.05]
    # a frame of another kind, or none, failed with KeyError: 'rank'
    with pytest.raises(ValueError, match=r"activation_peaks_figure: the frame lacks 'variant', 'rank', 'measured MiB', "
                                         r"'estimated MiB' \(its columns: \['x'\]\); expected one row per variant"):
        activation_peaks_figure(pd.DataFrame({"x": [1]}))
    with pytest.raises(ValueError, match=r"activation_peaks_figure: the frame has no rows"):
        activation_peaks_figure(peaks.iloc[:0])
    with pytest.raises(TypeError, match=r"activation_peaks_figure: expected a pandas DataFrame"):
        activation_peaks_figure([1, 2])


def test_memory_figure_labels_axes_and_keeps_peak_labels_clear():
    from mlmkit.viz import memory_figure

    rows = [dict(rank=r, time=t, parameters=1e6, gradients=1e6, optimizer=2e6, activations=a, activations_peak=a)
            for r in (0, 1) for t, a in ((0.0, 0.0), (0.1, 3e6), (0.2, 1e6))]
    fig = memory_figure(pd.DataFrame(rows))
    assert fig.layout.xaxis.title.text == "time (s)" and fig.layout.yaxis.title.text == "MiB"
    peak = max(t.y[0] for t in fig.data if t.name == "peak")
    assert fig.layout.yaxis.range[1] >= 1.2 * peak                      # headroom under the subplot title
    assert all(t.textposition == "bottom left" for t in fig.data if t.name == "peak")
