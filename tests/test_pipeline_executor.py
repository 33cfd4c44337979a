"""The executor runs the same Schedule objects on real gloo ranks and matches the serial GPT."""

import pytest
import torch

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, RankFailure, run_ranks
from mlmkit.model import GPT, gather_full, tiny_config
from mlmkit.pipeline import Action, ScheduleError, make_schedule
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks
from mlmkit.trace import Tracer

CFG = tiny_config(layers=8, hidden=32, heads=4, seq_len=8)
MB_SIZE = 2
TOL = 1e-5


def _data(m):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab_size, (m * MB_SIZE, CFG.seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (m * MB_SIZE, CFG.seq_len), generator=g)
    return tokens, targets


def _serial(m):
    model = GPT(CFG)
    tokens, targets = _data(m)
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline_rank(rank, world_size, name, tp, pp, m, chunks, sp, stepwise):
    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(Topology(tp=tp, pp=pp), tracer=tracer)
    schedule = make_schedule(name, stages=pp, microbatches=m, chunks=chunks, layers=CFG.layers)
    model_chunks = build_model_chunks(CFG, groups=groups, chunks=chunks, sequence_parallel=sp)
    ex = PipelineExecutor(schedule=schedule, chunks=model_chunks, groups=groups)
    tokens, targets = _data(m)
    states = []
    if stepwise:
        ex.start_step(tokens, targets)
        while not ex.done:
            ex.step_action()
            states.append(ex.state())
        ex.finalize()
        loss = ex.loss
    else:
        loss = ex.run_step(tokens, targets)
    grads = {}
    for chunk in model_chunks:
        for n, g in gather_full(chunk, grads=True).items():
            grads[n if n != "head_weight" else "head_weight"] = g
    return {"loss": loss, "grads": grads if groups.coords.tp == 0 else None, "states": states,
            "events": tracer.event_frame(), "pp": groups.coords.pp}


def _check(results, m):
    ref_loss, ref_grads = _serial(m)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    for loss in losses:
        assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    merged = {}
    for r in results:
        if r["grads"] is not None:
            merged.update({k: v for k, v in r["grads"].items() if k != "head_weight"})
            if "head_weight" in r["grads"]:  # the last stage's copy of the tied embedding
                merged_head = r["grads"]["head_weight"]
                assert (merged_head - ref_grads["embedding.weight"]).abs().max().item() <= TOL
    assert set(merged) == set(ref_grads)
    for n, g in merged.items():
        diff = (g - ref_grads[n]).abs().max().item()
        assert diff <= TOL, f"{n}: max |grad diff| {diff:.2e}"


CASES = [
    ("gpipe", 1, 2, 4, 1), ("1f1b", 1, 2, 4, 1), ("interleaved-1f1b", 1, 2, 4, 2), ("zb-h1", 1, 2, 4, 1),
    ("gpipe", 1, 4, 4, 1), ("1f1b", 1, 4, 8, 1), ("interleaved-1f1b", 1, 4, 4, 2), ("zb-h1", 1, 4, 4, 1),
    ("gpipe", 2, 2, 4, 1), ("1f1b", 2, 2, 4, 1), ("interleaved-1f1b", 2, 2, 4, 2), ("zb-h1", 2, 2, 4, 1),
]


@pytest.mark.parametrize("name,tp,pp,m,chunks", CASES)
def test_pipeline_matches_serial(name, tp, pp, m, chunks):
    results = run_ranks(_pipeline_rank, world_size=tp * pp, args=(name, tp, pp, m, chunks, False, False),
                        timeout_s=120)
    _check(results, m)
    # Every compute action of the schedule ran exactly once and was traced.
    for r in results:
        ev = r["events"]
        assert len(ev) == len(make_schedule(name, stages=pp, microbatches=m, chunks=chunks).compute_actions(r["pp"]))


def test_pipeline_with_sequence_parallel():
    results = run_ranks(_pipeline_rank, world_size=4, args=("1f1b", 2, 2, 4, 1, True, False), timeout_s=120)
    _check(results, 4)


def test_stepwise_equals_whole_step():
    results = run_ranks(_pipeline_rank, world_size=2, args=("interleaved-1f1b", 1, 2, 4, 2, False, True),
                        timeout_s=120)
    _check(results, 4)
    states = results[0]["states"]
    # While stepping, rank 0 held activations with their shapes; at the end nothing is held.
    peak = max(len(s.held) for s in states)
    assert peak >= 2
    held_shapes = [v for s in states for v in s.held.values()]
    assert {"input": None, "output": (CFG.seq_len, MB_SIZE, CFG.hidden)} in held_shapes
    assert states[-1].held == {} and states[-1].next_action is None


def _wrong_stages(rank, world_size):
    groups = ProcessGroups.build(Topology(pp=2))
    chunks = build_model_chunks(CFG, groups=groups)
    PipelineExecutor(schedule=make_schedule("1f1b", stages=4, microbatches=4), chunks=chunks, groups=groups)


def test_schedule_topology_mismatch_is_an_error():
    with pytest.raises(RankFailure, match="schedule has stages=4 but the topology has pp=2"):
        run_ranks(_wrong_stages, world_size=2)


def _broken(rank, world_size):
    from dataclasses import replace
    groups = ProcessGroups.build(Topology(pp=2))
    chunks = build_model_chunks(CFG, groups=groups)
    s = make_schedule("1f1b", stages=2, microbatches=2)
    acts = [a for a in s.actions[1] if a != Action("RECV_ACT", 1, 0, 0)]
    PipelineExecutor(schedule=replace(s, actions=(s.actions[0], tuple(acts))), chunks=chunks, groups=groups)
    return "ran"


def test_broken_schedule_never_executes():
    with pytest.raises(RankFailure) as info:
        run_ranks(_broken, world_size=2, timeout_s=60)
    assert "ScheduleError" in info.value.remote_traceback
    assert "RECV_ACT for microbatch 1 must come before" in info.value.remote_traceback


def test_more_stages_than_layers_fails_before_any_process():
    with pytest.raises(ScheduleError, match="8 stages .* but only layers=4"):
        make_schedule("interleaved-1f1b", stages=4, microbatches=4, chunks=2, layers=4)
    with pytest.raises(ValueError, match="8 pipeline stages .* only layers=4"):
        tiny_config(layers=4).check_parallel(pp=4, chunks=2)
