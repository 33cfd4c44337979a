"""The executor runs the same Schedule objects on real gloo ranks and matches the serial GPT."""

import os

import pandas as pd
import pytest
import torch

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, RankFailure, run_ranks
from mlmkit.model import GPT, gather_full, tiny_config
from mlmkit.pipeline import Action, Schedule, ScheduleError, make_schedule, replay
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks
from mlmkit.trace import Tracer
from mlmkit.trace.memory import MemoryTracker

from random_schedules import draw_schedule, seeds_from_env

CFG = tiny_config(layers=8, hidden=32, heads=4, seq_len=8)
MB_SIZE = 2
TOL = 1e-5


def _data(m, masked=False):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab_size, (m * MB_SIZE, CFG.seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (m * MB_SIZE, CFG.seq_len), generator=g)
    if masked:
        # Ignored targets, unevenly spread: microbatch i keeps a different number of tokens.
        keep = torch.rand(targets.shape, generator=g) < torch.linspace(0.2, 1.0, m * MB_SIZE)[:, None]
        targets = targets.masked_fill(~keep, -100)
        targets[0, 0] = 1                      # at least one real target
    return tokens, targets


_SERIAL = {}


def _serial(m, masked=False):
    if (m, masked) not in _SERIAL:
        model = GPT(CFG)
        tokens, targets = _data(m, masked)
        loss = model(tokens, targets)          # mean over every non-ignored token of the batch
        loss.backward()
        _SERIAL[(m, masked)] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    return _SERIAL[(m, masked)]


def _run_case(groups, tracer, case):
    name, m, chunks, sp, batch_p2p, masked, stepwise = case
    pp = groups.topology.pp
    tracer.clear()
    schedule = _schedule(case, pp)
    model_chunks = build_model_chunks(CFG, groups=groups, chunks=chunks, sequence_parallel=sp,
                                      split_backward=schedule.split_backward, placement=schedule.placement)
    memory = None
    if isinstance(name, Schedule):        # a random draw: its memory is held to the estimator's too
        memory = MemoryTracker(rank=groups.rank, params=[p for c in model_chunks for p in c.parameters()])
    ex = PipelineExecutor(schedule=schedule, chunks=model_chunks, groups=groups, batch_p2p=batch_p2p, memory=memory)
    tokens, targets = _data(m, masked)
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
    # A gradient is a plain tensor: one that carried an autograd graph (a deferred weight gradient
    # computed with grad mode on) would keep that graph, and the activations under it, alive.
    with_graph = [n for chunk in model_chunks for n, p in chunk.named_parameters()
                  if p.grad is not None and (p.grad.requires_grad or p.grad.grad_fn is not None)]
    grads = {}
    for chunk in model_chunks:
        grads.update(gather_full(chunk, grads=True))
    return {"loss": loss, "grads": grads if groups.coords.tp == 0 else None, "states": states,
            "with_graph": with_graph,
            "events": tracer.event_frame(), "pp": groups.coords.pp, "batched": ex.batch_p2p,
            "comm": tracer.comm_frame(), "memory": memory.frame() if memory is not None else None}


def _schedule(case, pp) -> Schedule:
    """A case's schedule: a generator's, by name, or a Schedule given as is (a random draw)."""
    name, m, chunks = case[:3]
    if isinstance(name, Schedule):
        return name
    group = None
    if name == "interleaved-1f1b" and m % pp:          # Megatron's microbatch groups: a group of 3 at m = 5
        group = next(n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp)
    return make_schedule(name, stages=pp, microbatches=m, chunks=chunks, layers=CFG.layers, microbatch_group=group)


def _pipeline_sweep(rank, world_size, tp, pp, cases):
    """One process group for many cases: every rank runs them in the same order."""
    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(Topology(tp=tp, pp=pp), tracer=tracer)
    return [_run_case(groups, tracer, case) for case in cases]


def _check(results, m, masked=False):
    ref_loss, ref_grads = _serial(m, masked)
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


def _describe(case) -> str:
    name, *rest = case
    if isinstance(name, Schedule):     # a random draw: its seed is in its name, its actions per rank
        rows = [" ".join(f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if name.chunks > 1 else "")
                         for a in name.compute_actions(r)) for r in range(name.stages)]
        return f"{name.name} ({name.placement}, m={name.microbatches}, v={name.chunks}; {' | '.join(rows)}) {rest}"
    return str(case)


def _sweep(tp, pp, cases):
    # 0.1-0.4 s a case: a long sweep (MLMKIT_RANDOM_SCHEDULES) gets a second a case
    per_rank = run_ranks(_pipeline_sweep, world_size=tp * pp, args=(tp, pp, cases), timeout_s=max(300, len(cases)))
    for i, case in enumerate(cases):
        name, m, chunks, sp, batch_p2p, masked, stepwise = case
        results = [per_rank[r][i] for r in range(tp * pp)]
        try:
            _check(results, m, masked)
        except AssertionError as err:
            raise AssertionError(f"case {_describe(case)}: {err}") from None
        assert all(r["batched"] == batch_p2p for r in results)
        assert not any(r["with_graph"] for r in results), (case, [r["with_graph"] for r in results])
        # Every compute action of the schedule ran exactly once and was traced.
        sched = _schedule(case, pp)
        for r in results:
            assert len(r["events"]) == len(sched.compute_actions(r["pp"])), case
        # The measured step is never shorter than its own action times replayed with free messages
        # (same order, same dependencies): what notebook 00 uses to explain a measured bubble.
        pipeline = Topology(tp=tp, pp=pp).groups("pp")[0]
        events = pd.concat([r["events"] for r in results])
        rep = replay(events, sched, ranks=pipeline)
        stages = events[events["rank"].isin(pipeline)]
        span = stages.end.max() - stages.start.min()
        assert rep.step_time <= span + 1e-6, (case, rep.step_time, span)
        if isinstance(name, Schedule):
            # the estimator reads the activations a rank holds from the schedule's own actions
            from mlmkit.estimate import estimate_memory
            from mlmkit.estimate.compare import compare_memory

            est = estimate_memory(CFG, Topology(tp=tp, pp=pp), micro_batch_size=MB_SIZE, microbatches=m, schedule=name,
                                  chunks=chunks, sequence_parallel=sp, precision="fp32")
            table = compare_memory(pd.concat([r["memory"] for r in results]), est)
            table = table[table.kind != "optimizer"]                 # no optimizer here
            assert (table.measured == table.estimated).all(), (_describe(case),
                                                               table[table.measured != table.estimated])
    return per_rank


def _cases(pp, *, batch_p2p, masked=False, ms=None):
    out = []
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"):
        chunks = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
        for m in ms or ((1 if pp == 2 else 2), pp, 2 * pp, 4 * pp):
            if (name == "interleaved-1f1b" and m < pp) or (name == "dualpipev" and m < 2 * pp):
                continue
            out.append((name, m, chunks, False, batch_p2p, masked, False))
    return out


@pytest.mark.parametrize("batch_p2p", [False, True], ids=["tagged", "batched"])
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_serial(pp, batch_p2p):
    # Both communication paths, every schedule, m from below p (1F1B and ZB-H1 only) up to 4p, and
    # interleaving with m not divisible by p (Megatron's microbatch groups).
    odd = [("interleaved-1f1b", 5 if pp == 2 else 9, 2, False, batch_p2p, False, False)]
    _sweep(1, pp, _cases(pp, batch_p2p=batch_p2p) + odd)


RANDOM_SCHEDULES = "MLMKIT_RANDOM_SCHEDULES"


def _random_cases(pp: int, seeds, *, tp: int = 1) -> list[tuple]:
    """One random valid order per seed (random_schedules.py): one chunk, interleaved in a loop or in
    a V; B or I then W per microbatch and stage; forward-eager or backward-eager; with masked
    targets, stepped action by action, sequence parallel (tp > 1) as the seed draws; both
    communication paths."""
    out = []
    placements = [(1, "loop"), (2, "loop"), (2, "v")] + ([(4, "loop")] if pp == 2 else [])
    for seed in seeds:
        sched, rng = draw_schedule(seed, stages=pp, placements=placements,
                                   microbatches=[1, 2, 3, pp, 2 * pp + 1, 3 * pp])
        for batch_p2p in (False, True):
            out.append((sched, sched.microbatches, sched.chunks, tp > 1 and rng.random() < 0.5, batch_p2p,
                        rng.random() < 0.3, rng.random() < 0.3))
    return out


@pytest.mark.parametrize("tp,pp,default", [(1, 2, "0:16"), (1, 4, "100:110"), (2, 2, "200:204")])
def test_random_valid_schedules_match_serial(tp, pp, default):
    # Not six orders but any the validator accepts (a schedule written by hand, or read from torch's
    # CSV): drawn by playing a step out one ready action at a time, each must give the serial loss and
    # gradients on both communication paths, run its actions once, hold no gradient graph, take no
    # less time than its own actions replayed, and hold the bytes estimate_memory reads from its
    # actions (exactly; 560 draws at pp=2 and 4 agreed). MLMKIT_RANDOM_SCHEDULES=A:B sweeps other seeds (for
    # every tp x pp here); 600 seeds at pp=2 and at pp=4 and 200 at tp=2 x pp=2 passed, each on both paths.
    seeds = seeds_from_env(RANDOM_SCHEDULES, default)
    cases = _random_cases(pp, seeds, tp=tp)
    drawn = {(c[0].chunks, c[0].placement, c[0].split_backward) for c in cases}
    if RANDOM_SCHEDULES not in os.environ and (tp, pp) == (1, 2):
        assert len(drawn) >= 5, drawn          # the default seeds draw loops, Vs, split and fused backward
    _sweep(tp, pp, cases)
    # a schedule of another pipeline is refused, not read for this one's activations
    from mlmkit.estimate import estimate_memory

    sched, m, chunks = cases[0][:3]
    with pytest.raises(ValueError, match=rf"the schedule has stages={pp}, microbatches={m}, chunks={chunks}; this "
                                         rf"estimate has pp={pp}, microbatches={m + 1}, chunks={chunks}"):
        estimate_memory(CFG, Topology(tp=tp, pp=pp), micro_batch_size=MB_SIZE, microbatches=m + 1, schedule=sched,
                        chunks=chunks, precision="fp32")


def test_tp_pipeline_sequence_parallel_and_masked_targets():
    # tp=2 x pp=2: both paths; sequence parallelism; targets partly ignored (per-token loss).
    cases = _cases(2, batch_p2p=False, ms=(4,)) + _cases(2, batch_p2p=True, ms=(4,))
    cases += [("1f1b", 4, 1, True, False, False, False), ("interleaved-1f1b", 4, 2, True, True, False, False)]
    cases += [(n, 4, c, False, b, True, False) for n, c in (("1f1b", 1), ("interleaved-1f1b", 2)) for b in (False, True)]
    per_rank = _sweep(2, 2, cases)
    # The batched path sends no tags (messages matched by order, as NCCL does) and traces its messages.
    batched = [i for i, c in enumerate(cases) if c[4]]
    comm = per_rank[0][batched[0]]["comm"]
    assert {"send", "recv"} <= set(comm.op) and set(comm.axis) >= {"pp"}


def _masked_microbatch_mean(rank, world_size):
    groups = ProcessGroups.build(Topology(pp=2))
    schedule = make_schedule("1f1b", stages=2, microbatches=4)
    chunks = build_model_chunks(CFG, groups=groups)
    ex = PipelineExecutor(schedule=schedule, chunks=chunks, groups=groups, per_token_loss=False)
    return ex.run_step(*_data(4, masked=True))


def test_mean_of_microbatch_means_is_not_the_serial_loss_with_ignored_targets():
    # Why the per-token loss is the default: averaging microbatch means weighs a token of a sparse
    # microbatch more than one of a dense microbatch.
    loss = [x for x in run_ranks(_masked_microbatch_mean, world_size=2) if x is not None][0]
    assert abs(loss - _serial(4, masked=True)[0]) > 10 * TOL   # far outside the parity tolerance


def test_stepwise_equals_whole_step():
    cases = [("interleaved-1f1b", 4, 2, False, False, False, True), ("interleaved-1f1b", 4, 2, False, True, False, True)]
    per_rank = _sweep(1, 2, cases)
    for k in range(2):
        states = per_rank[0][k]["states"]
        # While stepping, rank 0 held activations with their shapes; at the end nothing is held.
        peak = max(len(s.held) for s in states)
        assert peak >= 2
        held_shapes = [v for s in states for v in s.held.values()]
        assert {"input": None, "output": (CFG.seq_len, MB_SIZE, CFG.hidden)} in held_shapes
        assert states[-1].held == {} and states[-1].next_action is None
    # The batched executor steps whole batches: fewer steps than actions.
    assert len(per_rank[0][1]["states"]) < len(per_rank[0][0]["states"])


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



BAD_BATCHES = [   # (name, change to the good batch, the error every rank raises)
    ("token past the vocabulary", lambda t, y: (t.index_fill(1, torch.tensor([3]), CFG.vocab_size), y),
     f"token id {CFG.vocab_size} is outside the vocabulary"),
    ("negative token", lambda t, y: (t.index_fill(1, torch.tensor([0]), -1), y), "token id -1 is outside"),
    ("target past the vocabulary", lambda t, y: (t, y.index_fill(1, torch.tensor([7]), CFG.vocab_size)),
     f"target id {CFG.vocab_size} is outside the vocabulary [0, {CFG.vocab_size}) and is not ignore_index=-100"),
    ("negative target", lambda t, y: (t, y.index_fill(1, torch.tensor([2]), -5)), "target id -5 is outside"),
    ("float tokens", lambda t, y: (t.float(), y), "tokens must be an integer tensor [batch, seq]"),
    ("shapes apart", lambda t, y: (t, y[:, :-1]), "and targets [8, 7] must have the same shape"),
    ("too long", lambda t, y: (t.repeat(1, 2), y.repeat(1, 2)), "sequence length 16 exceeds GPTConfig.seq_len=8"),
]


def _bad_batches(rank, world_size, batch_p2p):
    torch.manual_seed(0)
    groups = ProcessGroups.build(Topology(tp=2, pp=2))
    schedule = make_schedule("1f1b", stages=2, microbatches=4)
    chunks = build_model_chunks(CFG, groups=groups, sequence_parallel=True)
    ex = PipelineExecutor(schedule=schedule, chunks=chunks, groups=groups, batch_p2p=batch_p2p)
    tokens, targets = _data(4)
    errors = []
    for _, change, _ in BAD_BATCHES:
        try:
            ex.start_step(*change(tokens, targets))
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
        assert not ex._open                  # refused before the step began
    loss = ex.run_step(tokens, targets)       # the same executor then runs a good batch
    return errors, loss, {n: g for n, g in gather_full(chunks[0], grads=True).items()}


@pytest.mark.parametrize("batch_p2p", [False, True])
def test_a_batch_no_step_can_run_is_refused_on_every_rank_before_the_step(batch_p2p):
    # A bad id reached only the stage that reads it, mid-step, while the other stage waited for its
    # messages; a target past the vocabulary was a logit of 0 (a loss of no model, no error).
    results = run_ranks(_bad_batches, world_size=4, args=(batch_p2p,), timeout_s=120)
    for errors, _, _ in results:
        for (name, _, needle), err in zip(BAD_BATCHES, errors):
            assert err is not None and needle in err, (name, err)
    ref_loss, ref_grads = _serial(4)
    losses = [loss for _, loss, _ in results if loss is not None]
    assert losses and all(abs(loss - ref_loss) <= TOL for loss in losses)
    for _, _, grads in results:
        for n, g in grads.items():
            if n in ref_grads:
                assert (g - ref_grads[n]).abs().max().item() <= TOL, n
    # the serial model's loss refuses such targets too (torch's cross_entropy raises)
    tokens, targets = _data(1)
    with pytest.raises(ValueError, match=f"target id {CFG.vocab_size} is outside the vocabulary"):
        GPT(CFG)(tokens, targets.index_fill(1, torch.tensor([5]), CFG.vocab_size))


def test_more_stages_than_layers_fails_before_any_process():
    with pytest.raises(ScheduleError, match="8 stages .* but only layers=4"):
        make_schedule("interleaved-1f1b", stages=4, microbatches=4, chunks=2, layers=4)
    with pytest.raises(ValueError, match="8 pipeline stages .* only layers=4"):
        tiny_config(layers=4).check_parallel(pp=4, chunks=2)


# ------------------------------------------------------------------------------- uneven stages
UNEVEN = [("1f1b", 1, (5, 3)), ("zb-h1", 1, (2, 6)), ("interleaved-1f1b", 2, (3, 1, 2, 2)), ("zb-v", 2, (1, 3, 2, 2))]


def _uneven_sweep(rank, world_size, m):
    groups = ProcessGroups.build(Topology(pp=world_size))
    out = []
    for name, chunks, counts in UNEVEN:
        schedule = make_schedule(name, stages=world_size, microbatches=m, chunks=chunks)
        models = build_model_chunks(CFG, groups=groups, chunks=chunks, layers_per_stage=counts,
                                    placement=schedule.placement, split_backward=schedule.split_backward)
        memory = MemoryTracker(rank=groups.rank, params=[p for model in models for p in model.parameters()])
        ex = PipelineExecutor(schedule=schedule, chunks=models, groups=groups, memory=memory)
        loss = ex.run_step(*_data(m))
        grads = {}
        for model in models:
            grads.update(gather_full(model, grads=True))
        out.append({"loss": loss, "grads": grads, "memory": memory.frame(),
                    "layers": [list(model.stage.layers) for model in models]})
    return out


def test_stages_of_unequal_layer_counts_match_serial_and_their_estimate():
    # layers_per_stage (the executor's and the estimators'): every layer once, in order, on the
    # virtual stage the counts give it (the V placement's too), the serial model's loss and
    # gradients, and the estimators' bytes for that split. The estimators once took any counts
    # (a list for 6 layers of an 8-layer model estimated 6) while the model refused them.
    from mlmkit.estimate import estimate_memory
    from mlmkit.estimate.compare import compare_memory

    m = 4
    per_rank = run_ranks(_uneven_sweep, world_size=2, args=(m,), timeout_s=300)
    for i, (name, chunks, counts) in enumerate(UNEVEN):
        results = [per_rank[r][i] for r in range(2)]
        _check(results, m)
        schedule = make_schedule(name, stages=2, microbatches=m, chunks=chunks)
        starts = [sum(counts[:vs]) for vs in range(len(counts))]
        for r in range(2):
            want = [list(range(starts[vs], starts[vs] + counts[vs]))
                    for vs in (schedule.virtual_stage(r, c) for c in range(chunks))]
            assert results[r]["layers"] == want, (name, r, results[r]["layers"], want)
        est = estimate_memory(CFG, Topology(pp=2), micro_batch_size=MB_SIZE, microbatches=m, schedule=name,
                              chunks=chunks, precision="fp32", layers_per_stage=counts)
        table = compare_memory(pd.concat([r["memory"] for r in results]), est)
        table = table[table.kind != "optimizer"]                 # no optimizer here
        assert (table.measured == table.estimated).all(), (name, table[table.measured != table.estimated])
        even = estimate_memory(CFG, Topology(pp=2), micro_batch_size=MB_SIZE, microbatches=m, schedule=name,
                               chunks=chunks, precision="fp32")
        assert not est.equals(even)                              # the split really moved bytes
    for bad in ((3, 3), (4, 4, 0), (4.0, 4.0), {3, 5}):
        with pytest.raises(ValueError, match=r"layers_per_stage=.* (must list 2 positive whole counts summing to 8|"
                                             r"must be a list of 2 layer counts)"):
            estimate_memory(CFG, Topology(pp=2), micro_batch_size=MB_SIZE, microbatches=m, precision="fp32",
                            layers_per_stage=bad)


# ------------------------------------------------------------------------------- memory held in a step
def _untracked(groups, name, m, chunks, batch_p2p):
    """The most bytes alive on this rank during a step beyond what MemoryTracker counts."""
    from live_bytes import LiveBytes

    schedule = make_schedule(name, stages=groups.topology.pp, microbatches=m, chunks=chunks)
    models = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=schedule.placement,
                                split_backward=schedule.split_backward)
    params = [p for model in models for p in model.parameters()]
    memory = MemoryTracker(rank=groups.rank, params=params)
    ex = PipelineExecutor(schedule=schedule, chunks=models, groups=groups, memory=memory, batch_p2p=batch_p2p)
    tokens, targets = _data(m)
    ex.run_step(tokens, targets)             # gradients exist from here on, as in training
    live, worst, rows = LiveBytes(), 0, len(memory.rows)
    for p in params:
        live.add(p)
        live.add(p.grad)
    live.ignore(tokens)                      # the batch: the step's input, not what it holds
    live.ignore(targets)
    with live:
        ex.start_step(tokens, targets)
        while not ex.done:
            ex.step_action()
            if len(memory.rows) > rows:          # a compute action ended: compare
                rows = len(memory.rows)
                _, _, _, _, _, params_b, grads_b, opt_b, acts_b, *_ = memory.rows[-1]
                worst = max(worst, live.bytes - (params_b + grads_b + opt_b + acts_b))
        ex.finalize()
    return worst


def _untracked_sweep(rank, world_size, cases):
    groups = ProcessGroups.build(Topology(pp=world_size))
    return [_untracked(groups, *case) for case in cases]


MEMORY_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zb-v": 2, "dualpipev": 2}


@pytest.mark.parametrize("pp", [2, 4])
def test_memory_beyond_the_tracker_does_not_grow_with_microbatches(pp):
    # What a rank holds beyond the tracker's count (the stage outputs kept for backward, received
    # tensors not yet consumed, sends in flight) is bounded by the schedule's microbatches in
    # flight, not by m: measured independently (tests/live_bytes.py) at m = 2p and m = 4p, both
    # communication paths. A sent tensor kept until the end of the step, or a weight gradient that
    # keeps an autograd graph, grows with m. GPipe holds every microbatch's output until its
    # backward: the control that the measurement sees such growth.
    message = CFG.seq_len * MB_SIZE * CFG.hidden * 4                      # one activation, bytes
    cases = [(name, m, chunks, batched) for name, chunks in MEMORY_SCHEDULES.items()
             for batched in (False, True) for m in (2 * pp, 4 * pp)]
    per_rank = run_ranks(_untracked_sweep, world_size=pp, args=(cases,), timeout_s=300)
    worst = {case: max(r[i] for r in per_rank) for i, case in enumerate(cases)}
    for name, chunks in MEMORY_SCHEDULES.items():
        for batched in (False, True):
            few, many = worst[name, 2 * pp, chunks, batched], worst[name, 4 * pp, chunks, batched]
            if name == "gpipe":
                assert many >= few + 2 * pp * message - message // 4, (name, batched, few, many)
            else:
                assert many <= few + message // 4, (name, batched, few // message, many // message)


# ------------------------------------------------------------------------------- receives posted ahead
def _lookahead_case(groups, name, m, chunks, lookahead):
    schedule = make_schedule(name, stages=groups.topology.pp, microbatches=m, chunks=chunks)
    models = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=schedule.placement,
                                split_backward=schedule.split_backward)
    ex = PipelineExecutor(schedule=schedule, chunks=models, groups=groups, batch_p2p=False)
    default = ex.recv_lookahead
    ex.recv_lookahead = default if lookahead is None else lookahead
    tokens, targets = _data(m)
    ex.start_step(tokens, targets)
    posted = 0                                   # most receives posted and not yet used, after a compute action
    while not ex.done:
        a = ex.step_action()
        if a.kind in ("F", "B", "I", "W"):
            posted = max(posted, len(ex._recv))
    ex.finalize()
    grads = {}
    for chunk in models:
        grads.update(gather_full(chunk, grads=True))
    return {"loss": ex.loss, "grads": grads, "posted": posted, "default": default}


def _lookahead_sweep(rank, world_size, cases):
    groups = ProcessGroups.build(Topology(pp=world_size))
    return [_lookahead_case(groups, *case) for case in cases]


@pytest.mark.parametrize("pp", [2, 4])
def test_receives_posted_ahead_change_no_number(pp):
    # Unbatched gloo posts the receives of the next few compute actions before each compute action
    # (executor docstring). Every schedule (pp=2: a rank's previous and next stage are the same peer
    # with interleaving and V shapes) gives bit-identical losses and gradients with receives posted
    # when reached (0), ahead by default, and all at the step's first compute action (10**6: many
    # receives of equal shapes outstanding on one peer at once, matched by their tags only).
    m = 2 * pp
    cases = [(name, m, chunks, k) for name, chunks in MEMORY_SCHEDULES.items() for k in (0, None, 10**6)]
    per_rank = run_ranks(_lookahead_sweep, world_size=pp, args=(cases,), timeout_s=300)
    ref_loss, ref_grads = _serial(m)
    more = 0
    for name, chunks in MEMORY_SCHEDULES.items():
        runs = {k: [per_rank[r][cases.index((name, m, chunks, k))] for r in range(pp)] for k in (0, None, 10**6)}
        assert runs[None][0]["default"] > 0
        assert max(r["posted"] for r in runs[0]) == 0, name
        assert max(r["posted"] for r in runs[None]) >= 1, name        # posted ahead, really
        assert max(r["posted"] for r in runs[10**6]) >= max(r["posted"] for r in runs[None]), name
        more += max(r["posted"] for r in runs[10**6]) > max(r["posted"] for r in runs[None])
        for k in (None, 10**6):
            for mine, base in zip(runs[k], runs[0]):
                assert (mine["loss"] is None) == (base["loss"] is None)
                if base["loss"] is not None:
                    assert mine["loss"] == base["loss"], (name, k)
                    assert abs(base["loss"] - ref_loss) <= TOL, (name, base["loss"], ref_loss)
                assert set(mine["grads"]) == set(base["grads"])
                for n, g in mine["grads"].items():
                    assert torch.equal(g, base["grads"][n]), (name, k, n)
    assert more, "posting every receive at once never held more than the default lookahead"


def _restart_half_way(rank, world_size, name, chunks, batch_p2p):
    # After each round of a lockstep stepping that never blocks (either communication path), a rank
    # with actions left refuses a new start_step (its messages are in flight, and the next step's
    # receives would carry the same tags), and so does one whose actions are done before finalize()
    # (its gradient sums over stages not made); the step then finishes and equals an uninterrupted one.
    from mlmkit.pipeline import ScheduleCursor
    from mlmkit.pipeline.batching import BatchCursor, plan_batches

    torch.set_num_threads(1)
    groups = ProcessGroups.build(Topology(pp=world_size))
    m = 2 * world_size
    schedule = make_schedule(name, stages=world_size, microbatches=m, chunks=chunks, layers=CFG.layers)
    model_chunks = build_model_chunks(CFG, groups=groups, chunks=chunks, split_backward=schedule.split_backward,
                                      placement=schedule.placement)
    ex = PipelineExecutor(schedule=schedule, chunks=model_chunks, groups=groups, batch_p2p=batch_p2p)
    cursor = BatchCursor(plan_batches(schedule)) if batch_p2p else ScheduleCursor(schedule)
    me = groups.coords.pp
    prefixes = [0]
    while cursor.runnable():
        if batch_p2p:
            cursor.advance_round()
        else:
            for r in cursor.runnable():
                cursor.advance(r)
        prefixes.append((cursor.pos if batch_p2p else cursor.index)[me])
    tokens, targets = _data(m)
    refused, losses, done_after = [], [], []
    for prefix in prefixes:
        for model in model_chunks:
            model.zero_grad(set_to_none=True)
        ex.start_step(tokens, targets)
        for _ in range(prefix):
            ex.step_action()
        done_after.append(ex.done)
        try:
            ex.start_step(tokens, targets)
        except RuntimeError as err:
            refused.append((ex.index, str(err)))
        while not ex.done:
            ex.step_action()
        ex.finalize()
        losses.append(ex.loss)
    grads = {}
    for chunk in model_chunks:
        grads.update(gather_full(chunk, grads=True))
    return {"refused": refused, "losses": losses, "grads": grads, "actions": len(ex.actions),
            "done_after": done_after}


@pytest.mark.parametrize("batch_p2p", [False, True])
@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("zb-v", 2)])
def test_a_step_in_progress_is_not_started_over(name, chunks, batch_p2p):
    results = run_ranks(_restart_half_way, world_size=2, args=(name, chunks, batch_p2p), timeout_s=120)
    ref_loss, ref_grads = _serial(4)
    for rank, r in enumerate(results):
        n = r["actions"]
        assert len(r["refused"]) == len(r["done_after"]) and r["done_after"][-1] and not r["done_after"][0]
        for index, message in r["refused"]:
            if index < n:
                assert message.startswith(f"start_step: a step is in progress on pipeline rank {rank} (action "
                                          f"{index} of {n} done, "), message
                assert "abandon()" in message
            else:                                        # every action run, the gradient sums not yet
                assert message.startswith(f"start_step: the step on pipeline rank {rank} has run its actions but "
                                          f"not finalize()"), message
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert len(losses) == 1 and all(abs(x - ref_loss) <= TOL for x in losses[0])
    merged = {}
    for r in results:
        merged.update(r["grads"])
    merged["embedding.weight"] = merged.pop("head_weight")   # the tied copies, summed by finalize()
    assert set(merged) == set(ref_grads)
    for n, g in merged.items():                          # the last step's gradients: as the serial model's
        assert (g - ref_grads[n]).abs().max().item() <= TOL, n
