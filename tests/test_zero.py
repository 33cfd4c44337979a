"""ZeRO-2 and ZeRO-3 (fully sharded data parallelism) against the serial model: losses and every
parameter after 3 steps in every layout of the parity suite; checkpoints across stages and dp;
model-state memory and dp bytes against the estimator; bad input."""

import pytest
import torch

from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.estimate import estimate_train_comm, estimate_train_memory
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.model import GPTConfig, gather_full
from mlmkit.model.config import llama_config
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.checkpoint import load_checkpoint, save_checkpoint
from mlmkit.train.trainer import Trainer, traced_step

from parity_helpers import bf16_params_close

GPT2 = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4)
LLAMA = llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4, ffn_hidden=64)
STEPS = 3
FP32_TOL = 1e-5
PARAM_TOL = 5e-5          # parameters after 3 AdamW steps: see tests/test_context_parallel.py
BF16_LOSS_RTOL = 1e-2


def _config(model=GPT2, **options) -> TrainConfig:
    base = dict(micro_batch_size=2, global_batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=1, max_steps=5,
                grad_clip=0.5, weight_decay=0.01)
    return TrainConfig(model=model, **{**base, **options})


def _train(rank, world_size, cfg_dict):
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single()
    trainer = Trainer(cfg, groups=groups)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    with trainer.full_parameters():
        params = {}
        for chunk in trainer.chunks:
            params.update(gather_full(chunk))
    c = groups.coords
    keeper = c.tp == 0 and c.dp == 0 and c.cp == 0
    return {"losses": losses, "params": params if keeper else {}}


_SERIAL = {}


def _serial(cfg: TrainConfig) -> dict:
    key = (cfg.model, cfg.precision, cfg.global_batch_size)
    if key not in _SERIAL:
        _SERIAL[key] = _train(0, 1, _config(cfg.model, precision=cfg.precision,
                                            global_batch_size=cfg.global_batch_size).to_dict())
    return _SERIAL[key]


LAYOUTS = {
    "zero2-dp2": dict(zero=2, dp=2),
    "zero2-dp4-tp2-sp": dict(zero=2, dp=4, tp=2, sequence_parallel=True),
    "zero2-pp2-dp2-zbh1": dict(zero=2, pp=2, dp=2, schedule="zb-h1"),
    "zero3-dp2": dict(zero=3, dp=2),
    "zero3-dp4": dict(zero=3, dp=4),
    "zero3-dp2-tp2": dict(zero=3, dp=2, tp=2),
    "zero3-dp2-pp2-1f1b-prefetch": dict(zero=3, dp=2, pp=2, prefetch=1),
    "zero3-dp2-pp2-interleaved-batched": dict(zero=3, dp=2, pp=2, schedule="interleaved-1f1b", chunks=2,
                                              batch_p2p=True),
    "zero3-dp2-pp2-zbh1-keep": dict(zero=3, dp=2, pp=2, schedule="zb-h1", reshard_after_forward=False),
    "zero3-dp2-pp2-zbv": dict(zero=3, dp=2, pp=2, schedule="zb-v", chunks=2),
    "zero3-dp2-pp2-dualpipev-prefetch": dict(zero=3, dp=2, pp=2, schedule="dualpipev", chunks=2, prefetch=1,
                                             global_batch_size=16),
    "zero3-dp2-full-recompute-prefetch": dict(zero=3, dp=2, recompute="full", prefetch=1),
    "zero3-llama-cp2-dp2-selective": dict(model=LLAMA, zero=3, cp=2, dp=2, recompute="selective"),
    "zero3-llama-dp2-tp2-sp-bf16": dict(model=LLAMA, zero=3, dp=2, tp=2, sequence_parallel=True, precision="bf16"),
    "zero2-llama-dp2-bf16-bf16reduce": dict(model=LLAMA, zero=2, dp=2, precision="bf16", grad_reduce="bf16"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_layout_matches_serial(layout):
    cfg = _config(**LAYOUTS[layout])
    results = run_ranks(_train, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300)
    ref = _serial(cfg)
    bf16 = cfg.precision == "bf16"
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            tol = (BF16_LOSS_RTOL if bf16 else FP32_TOL) * abs(want)
            assert abs(got - want) <= tol, (layout, r["losses"], ref["losses"])
    params = {}
    for r in results:
        params.update(r["params"])
    tied = params.pop("head_weight", None) if "head_weight" not in ref["params"] else None
    if tied is not None:                        # the last stage's copy of the tied embedding
        assert (tied.double() - params["embedding.weight"].double()).abs().max() <= PARAM_TOL
    assert set(params) == set(ref["params"])
    for name, want in ref["params"].items():
        got = params[name]
        if bf16:     # against bf16's own error (serial bf16 vs serial fp32), as parity_helpers explains
            fp32 = _serial(_config(cfg.model, global_batch_size=cfg.global_batch_size))
            assert bf16_params_close(got, want, fp32["params"][name], tp=cfg.tp), (layout, name)
        else:
            assert (got.double() - want.double()).abs().max() <= PARAM_TOL, (layout, name)
    assert ref["losses"][-1] < ref["losses"][0]


# ------------------------------------------------------------------------------- against the estimator
TRACED = {
    "zero2-dp2-tp2-sp": dict(zero=2, dp=2, tp=2, sequence_parallel=True),
    "zero3-dp4": dict(zero=3, dp=4),
    "zero3-dp2-pp2-prefetch-full": dict(zero=3, dp=2, pp=2, prefetch=1, recompute="full"),
    "zero3-dp2-pp2-interleaved-keep": dict(zero=3, dp=2, pp=2, schedule="interleaved-1f1b", chunks=2,
                                           reshard_after_forward=False),
    "zero3-llama-cp2-dp2-bf16-zbv": dict(model=LLAMA, zero=3, cp=2, dp=1, pp=2, schedule="zb-v", chunks=2,
                                         precision="bf16"),
}


@pytest.fixture(scope="module")
def traced():
    out = {}
    for name, options in TRACED.items():
        cfg = _config(**options)
        out[name] = cfg, merge_traces(run_ranks(traced_step, world_size=cfg.world_size, args=(cfg.to_dict(),),
                                                timeout_s=300))
    return out


@pytest.mark.parametrize("name", list(TRACED))
def test_model_state_memory_and_dp_bytes_equal_the_estimate(traced, name):
    cfg, traces = traced[name]
    memory = compare_memory(traces["memory"], estimate_train_memory(cfg))
    state = memory[memory.kind.isin(["parameters", "gradients", "optimizer"])]
    assert (state.measured == state.estimated).all(), state[state.measured != state.estimated]
    comm = compare_comm(traces["comm"], estimate_train_comm(cfg))
    assert (comm.measured == comm.estimated).all(), comm[comm.measured != comm.estimated]
    assert comm[comm.kind == "dp"].measured.gt(0).all()


# ------------------------------------------------------------------------------- checkpoints
def _save(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    save_checkpoint(trainer, directory)
    losses += [trainer.train_step()["loss"] for _ in range(2)]
    # In the same processes: a fresh trainer resumed from the checkpoint continues exactly.
    resumed = Trainer(cfg, groups=trainer.groups)
    assert load_checkpoint(resumed, directory) == 2
    return losses, [resumed.train_step()["loss"] for _ in range(2)]


def _resume(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single()
    trainer = Trainer(cfg, groups=groups)
    assert load_checkpoint(trainer, directory) == 2
    return [trainer.train_step()["loss"] for _ in range(2)]


@pytest.mark.parametrize("saved_options", [dict(zero=3, dp=2, pp=2), dict(zero=2, dp=4)], ids=["zero3-dp2-pp2", "zero2-dp4"])
def test_checkpoint_resumes_exactly_in_other_stages_and_layouts(tmp_path, saved_options):
    saved = _config(**saved_options)
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_save, world_size=saved.world_size, args=(saved.to_dict(), directory), timeout_s=300)
    losses, same = results[0]
    assert same == pytest.approx(losses[2:], rel=1e-6)
    for options in (dict(), dict(zero=3, dp=4), dict(zero=1, dp=2, tp=2), dict(zero=3, dp=2, prefetch=1)):
        cfg = _config(**options)
        got = run_ranks(_resume, world_size=cfg.world_size, args=(cfg.to_dict(), directory), timeout_s=300)[0] \
            if cfg.world_size > 1 else _resume(0, 1, cfg.to_dict(), directory)
        assert got == pytest.approx(losses[2:], rel=1e-6), (options, got, losses[2:])


def _resume_weights(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single())
    load_checkpoint(trainer, directory)
    with trainer.full_parameters():
        weights = {n: p.detach().clone() for c in trainer.chunks for n, p in gather_full(c).items()}
    return weights, [trainer.train_step()["loss"] for _ in range(2)]


def test_a_mixed_precision_checkpoint_resumes_in_fp32_from_its_master_weights(tmp_path):
    # An fp32 trainer loaded a bf16 checkpoint's bf16 parameters (its weights rounded, up to 4e-3
    # off here) and ignored the fp32 masters beside them, except ZeRO-1/2/3's shards, which took
    # the masters: two layouts of one resume then trained on from different weights.
    from mlmkit.train.checkpoint import export_state_dict

    directory = str(tmp_path / "ckpt")
    source = Trainer(_config(precision="bf16"), groups=ProcessGroups.single())
    for _ in range(2):
        source.train_step()
    save_checkpoint(source, directory)
    masters = {n: s["master"] for n, s in source.optimizer.state_by_name()[0].items()}
    exported = export_state_dict(directory)
    assert all(exported[n].dtype == torch.float32 and torch.equal(exported[n], masters[n]) for n in masters)
    runs = {}
    for options in (dict(), dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=3), dict(precision="bf16")):
        cfg = _config(**options)
        runs[str(options)] = run_ranks(_resume_weights, world_size=cfg.world_size, args=(cfg.to_dict(), directory),
                                       timeout_s=300)[0] if cfg.world_size > 1 else \
            _resume_weights(0, 1, cfg.to_dict(), directory)
    for options, (weights, losses) in runs.items():
        for n, m in masters.items():
            want = m if "bf16" not in options else m.to(torch.bfloat16)
            assert torch.equal(weights[n], want), (options, n, (weights[n].float() - m).abs().max())
        if "bf16" not in options:
            assert losses == pytest.approx(runs["{}"][1], rel=1e-6), (options, losses)


TINY_LR, TINY_STEPS = 5e-6, 4


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_updates_below_bf16_resolution_accumulate_in_the_fp32_masters(zero):
    # Mixed precision keeps fp32 master weights because an update smaller than half a bf16 step of
    # the weight rounds away in bf16: without masters such updates never move it. With lr 5e-6 each
    # AdamW step moves an element by about 5e-6 (its first step by exactly lr), below half a bf16
    # step for most weights here. After 4 steps the masters must have moved by at least lr in most
    # of the elements whose whole move is below half a bf16 step of their first value, and every
    # bf16 weight is its master rounded. A masterless update (the masters rounded to bf16 after every
    # step) leaves those elements where they were and fails here in every ZeRO stage; the 200-step
    # run of test_llama catches it only by a margin of 0.3%.
    cfg = _config(precision="bf16", zero=zero, lr=TINY_LR, min_lr=TINY_LR, warmup_steps=0, weight_decay=0.0,
                  grad_clip=0.0)
    trainer = Trainer(cfg, groups=ProcessGroups.single())
    before = {n: s["master"] for n, s in trainer.optimizer.state_by_name()[0].items()}
    for _ in range(TINY_STEPS):
        trainer.train_step()
    after = {n: s["master"] for n, s in trainer.optimizer.state_by_name()[0].items()}
    with trainer.full_parameters():
        now = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    assert set(after) == set(now) and len(after) >= 4 * GPT2.layers
    for n in after:
        assert after[n].dtype == torch.float32 and torch.equal(now[n], after[n].to(torch.bfloat16)), n
    for n in (n for n in after if after[n].dim() == 2):
        start = before[n].to(torch.bfloat16).float()
        half_step = torch.ldexp(torch.ones_like(start), torch.frexp(start).exponent - 9)     # half a bf16 step
        moved = (after[n] - before[n]).abs()
        below = moved[(moved < half_step) & (start != 0)]
        assert below.numel() > moved.numel() // 4, (n, below.numel(), moved.numel())    # the regime is exercised
        assert below.median() >= TINY_LR, (n, below.median())                         # and the masters kept it


def _masters(trainer) -> dict:
    """The weights the optimizer updates, fp32, by name: the masters under bf16, else the parameters."""
    if trainer.config.precision == "bf16":
        return {n: s["master"] for n, s in trainer.optimizer.state_by_name()[0].items()}
    with trainer.full_parameters():
        return {n: p.detach().float().clone() for n, p in trainer.named_parameters()}


def _one_step_with_and_without_decay(rank, world_size, options, lr, wd):
    """(weights before, {decay: weights after one step}, shapes by name) on this rank (see below)."""
    after = {}
    for decay in (wd, 0.0):
        cfg = _config(lr=lr, min_lr=lr, warmup_steps=0, weight_decay=decay, **options)
        trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single())
        before = _masters(trainer)
        trainer.train_step()
        after[decay] = _masters(trainer)
    return before, after, {n: p.shape for n, p in trainer.named_parameters()}


DECAY_CASES = {"fp32": dict(), "zero1": dict(zero=1), "zero2": dict(zero=2), "zero3": dict(zero=3),
               "bf16": dict(precision="bf16"), "bf16-zero1": dict(zero=1, precision="bf16"),
               "bf16-zero3": dict(zero=3, precision="bf16"),
               # shards of two replicas: their cuts fall inside parameters
               "dp2": dict(dp=2), "dp2-zero1": dict(dp=2, zero=1), "dp2-zero2": dict(dp=2, zero=2),
               "dp2-zero3": dict(dp=2, zero=3), "dp2-bf16-zero1": dict(dp=2, zero=1, precision="bf16"),
               "dp2-bf16-zero3": dict(dp=2, zero=3, precision="bf16"),
               # tp shards (row-parallel biases and norm gains replicated over tp), pipeline stages
               "tp2-sp-dp2-zero2": dict(tp=2, sequence_parallel=True, dp=2, zero=2),
               "tp2-pp2-zbh1": dict(tp=2, pp=2, schedule="zb-h1")}


@pytest.mark.parametrize("case", list(DECAY_CASES))
def test_weight_decay_spares_biases_and_norm_gains(case):
    # Megatron-LM's default parameter groups: decay on matrices and embeddings, none on biases and
    # one-dimensional weights. Decoupled decay is w <- w (1 - lr wd) before the Adam update, so one
    # step with decay minus the same step without is -lr wd w0 on the decayed weights and nothing on
    # the others. Every optimizer (replicated, ZeRO-1/2/3 flat shards holding both kinds, the fp32
    # masters under bf16) used to decay every parameter.
    lr, wd, options = 1e-2, 0.1, DECAY_CASES[case]
    world = _config(**options).world_size
    args = (options, lr, wd)
    ranks = (run_ranks(_one_step_with_and_without_decay, world_size=world, args=args, timeout_s=300)
             if world > 1 else [_one_step_with_and_without_decay(0, 1, *args)])
    for rank, (before, after, shapes) in enumerate(ranks):       # each rank's own shards and stages
        spared = {n for n in after[wd] if n.endswith(".bias") or len(shapes[n]) == 1}
        assert spared and len(spared) < len(after[wd]), rank
        for n in after[wd]:
            if n in spared:
                assert torch.equal(after[wd][n], after[0.0][n]), (rank, n)
            else:
                torch.testing.assert_close(after[wd][n] - after[0.0][n], -lr * wd * before[n], rtol=1e-3, atol=1e-9,
                                           msg=f"rank {rank}: {n}")


def test_parameters_are_freed_between_steps_and_whole_on_demand():
    cfg = _config(zero=3, dp=1)
    trainer = Trainer(cfg, groups=ProcessGroups.single())
    trainer.train_step()
    freed = [p for _, p in trainer.named_parameters()]
    assert all(p.untyped_storage().nbytes() == p.element_size() for p in freed)     # a one-element placeholder
    with trainer.full_parameters():
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for _, p in trainer.named_parameters())
        whole = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    assert all(p.untyped_storage().nbytes() == p.element_size() for _, p in trainer.named_parameters())
    # Read between uses (a notebook printing a weight), a freed parameter shows NaN in its full shape
    # and refuses writes; it used to read and write freed memory (a segfault of the rank).
    weight = dict(trainer.named_parameters())["layers.0.attn.qkv.weight"]
    assert weight.shape == whole["layers.0.attn.qkv.weight"].shape and "nan" in repr(weight)
    assert torch.isnan(weight.sum()) and torch.isnan(weight.detach().norm())
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"), torch.no_grad():
        weight.add_(1.0)
    replicated = Trainer(cfg.replace(zero=0), groups=ProcessGroups.single())
    replicated.train_step()
    for n, p in replicated.named_parameters():
        assert torch.equal(p.detach(), whole[n]), n
    # Reading a freed parameter is refused by name (it used to read freed memory: a segfault).
    with pytest.raises(RuntimeError, match=r"'position' is sharded by ZeRO-3 .* trainer.full_parameters\(\)"):
        gather_full(trainer.chunks[0])
    with trainer.full_parameters():
        assert all(torch.equal(t, whole[n]) for n, t in gather_full(trainer.chunks[0]).items())


WRITTEN = "layers.0.attn.qkv.weight"


@pytest.mark.parametrize("options", [dict(), dict(zero=1), dict(zero=2), dict(zero=3), dict(precision="bf16"),
                                     dict(zero=1, precision="bf16"), dict(zero=3, precision="bf16")],
                         ids=["fp32", "zero1", "zero2", "zero3", "bf16", "bf16-zero1", "bf16-zero3"])
def test_weights_written_between_steps_are_what_the_next_step_trains(options):
    # trainer.full_parameters() says: wrap reads and writes of the weights. A write used to be undone
    # silently: at the end of the block (ZeRO-3: the shards were gathered again), or by the next
    # update (ZeRO-1/2 shards and bf16 fp32 masters wrote their old copy back). Now the optimizer's
    # copy takes what was written, and a block that only reads leaves every bit as it was.
    cfg = _config(dp=1, **options)
    written = Trainer(cfg, groups=ProcessGroups.single())
    written.train_step()
    with written.full_parameters(), torch.no_grad():
        dict(written.named_parameters())[WRITTEN].fill_(1.0)
    written.train_step()
    with written.full_parameters():
        after = dict(written.named_parameters())[WRITTEN].detach().float().clone()    # kept past the block
    assert (after - 1.0).abs().max() < 0.05, options        # 1.0 moved by one AdamW step (lr 3e-3)
    untouched, read = (Trainer(cfg, groups=ProcessGroups.single()) for _ in range(2))
    losses = [untouched.train_step()["loss"] for _ in range(3)]
    got = [read.train_step()["loss"]]
    with read.full_parameters():
        assert all(torch.isfinite(p).all() for _, p in read.named_parameters())
    got += [read.train_step()["loss"] for _ in range(2)]
    assert got == losses, options


@pytest.mark.parametrize("stage", [2, 3])
def test_whole_gradients_after_the_reduction_are_refused(stage):
    """ZeRO-2/3 keep only a shard of each reduced gradient: gather_full(grads=True) names the
    parameter instead of returning zeros for it; before the reduction it returns the local sums."""
    trainer = Trainer(_config(zero=stage, dp=1), groups=ProcessGroups.single())
    trainer.begin_step()
    trainer.executor.step_action()                      # one forward: no gradient yet, nothing reduced
    assert all(torch.count_nonzero(g) == 0 for g in gather_full(trainer.chunks[0], grads=True).values())
    while not trainer.executor.done:
        trainer.executor.step_action()
    trainer.executor.finalize()
    with pytest.raises(RuntimeError, match=f"reduce-scattered by ZeRO-{stage}"):
        gather_full(trainer.chunks[0], grads=True)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("options,needle", [
    (dict(zero=4), "zero=4 must be a ZeRO stage 0, 1, 2 or 3"),
    (dict(zero=True), "zero=True must be a ZeRO stage"),
    (dict(zero=2.0), "zero=2.0 must be a ZeRO stage 0, 1, 2 or 3"),      # a float passed and stayed one
    (dict(zero=3, prefetch=1.0), "prefetch=1.0 must be 0 or 1"),
    (dict(zero=3, zero1=True), "zero1=True asks for stage 1 but zero=3"),
    (dict(zero=2, prefetch=1), "prefetch and reshard_after_forward apply to zero=3 only"),
    (dict(zero=3, prefetch=2), "prefetch=2 must be 0 or 1"),
    (dict(zero=1, reshard_after_forward=False), "apply to zero=3 only (zero=1)"),
    (dict(zero=3, model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2, experts=4, top_k=2)),
     "zero=3 shards dense models only (experts=4); use zero=1"),
])
def test_bad_zero_configs_fail_before_any_process(options, needle):
    with pytest.raises(ValueError) as info:
        _config(**options)
    assert needle in str(info.value)


def test_numbers_read_from_a_table_are_integers():
    # A plan's or a sweep's DataFrame gives numpy integers. The degrees were refused with "tp=2 is
    # not an integer", ZeRO's stage passed but stayed a numpy type (the config's JSON then failed).
    # They are the ints they equal, stored as int; floats and bools are still refused.
    import json

    import numpy as np

    from mlmkit import Topology
    from mlmkit.plan import Layout

    i = np.int64
    model = GPTConfig(vocab_size=i(256), seq_len=np.int32(16), hidden=i(32), heads=i(4), layers=i(4))
    cfg = _config(model, tp=i(2), pp=i(2), dp=i(2), zero=i(3), prefetch=i(1), micro_batch_size=i(1),
                  global_batch_size=i(8), max_steps=i(5))
    assert cfg == _config(GPT2, tp=2, pp=2, dp=2, zero=3, prefetch=1, micro_batch_size=1, global_batch_size=8,
                          max_steps=5)
    assert all(type(v) is int for v in (cfg.tp, cfg.zero, cfg.prefetch, cfg.model.hidden, cfg.topology.tp))
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert Layout(tp=i(2), zero=i(3)) == Layout(tp=2, zero=3) and type(Layout(pp=i(2)).pp) is int
    # numpy floats too (np.float32 is no Python float: lr was refused as "must be a number")
    f = _config(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4, dropout=np.float32(0.5)),
                lr=np.float32(0.5), min_lr=np.float16(0.25))
    assert (type(f.lr), f.lr, f.min_lr, type(f.model.dropout), f.model.dropout) == (float, 0.5, 0.25, float, 0.5)
    for bad in (2.0, True):
        with pytest.raises(ValueError, match=f"tp={bad!r} is not an integer"):
            Topology(tp=bad)
    # numpy's bools (a DataFrame's boolean column) were refused as "must be true or false (a bool,
    # not bool)"; they are the bools they equal, and a one-element array is still refused.
    t, no = np.True_, np.False_
    b = _config(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4, bias=no, tie_embeddings=no),
                tp=2, sequence_parallel=t, tracing=no, per_token_loss=t, batch_p2p=t, zero=3, reshard_after_forward=no)
    assert b == _config(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4, bias=False,
                                  tie_embeddings=False), tp=2, sequence_parallel=True, tracing=False,
                        per_token_loss=True, batch_p2p=True, zero=3, reshard_after_forward=False)
    assert all(type(v) is bool for v in (b.sequence_parallel, b.tracing, b.batch_p2p, b.model.bias,
                                         b.reshard_after_forward))
    assert TrainConfig.from_dict(json.loads(json.dumps(b.to_dict()))) == b
    assert Topology(tp=2, experts=t).experts is True and Layout(sequence_parallel=no).sequence_parallel is False
    with pytest.raises(ValueError, match=r"sequence_parallel=array\(\[ True\]\) must be true or false"):
        _config(tp=2, sequence_parallel=np.array([True]))


def test_zero1_alias_and_replace():
    assert _config(zero1=True).zero == 1 and _config(zero=1).zero1
    cfg = _config(zero1=True).replace(zero=3)
    assert cfg.zero == 3 and not cfg.zero1
    assert _config(zero=3).replace(zero1=True).zero == 1
    assert TrainConfig.from_dict(_config(zero=3, prefetch=1).to_dict()) == _config(zero=3, prefetch=1)


def test_cli_zero3_matches_the_serial_run(tmp_path):
    import json
    import subprocess
    import sys

    def run(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
        assert out.returncode == 0, ("stdout:\n" + out.stdout[-1500:] + "\nstderr:\n" + out.stderr[:3000] + "\n...\n"
                                     + out.stderr[-1500:])
        return out.stdout, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    flags = ["-m", "mlmkit.train", "--tp", "1", "--pp", "1", "--steps", "2", "--micro-batch-size", "2"]
    _, serial = run([sys.executable, *flags])
    text, sharded = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *flags, "--dp", "2",
                         "--zero", "3", "--prefetch", "1"])
    assert "zero=3" in text
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in serial], abs=1e-5)
    bad = subprocess.run([sys.executable, *flags, "--zero", "2", "--prefetch", "1"], capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path))
    assert bad.returncode != 0 and "apply to zero=3 only" in bad.stderr


def test_zero3_moves_one_and_a_half_times_the_bytes_of_data_parallelism():
    # One microbatch per step and units that dp=2 divides: the ZeRO paper's 3 (d-1)/d N vs 2 (d-1)/d N.
    measured = {}
    for zero in (0, 1, 2, 3):
        cfg = _config(zero=zero, dp=2, global_batch_size=4)
        comm = merge_traces(run_ranks(traced_step, world_size=2, args=(cfg.to_dict(),), timeout_s=300))["comm"]
        measured[zero] = int(comm[comm.axis == "dp"].wire_bytes.sum())
        assert measured[zero] == int(estimate_train_comm(cfg).dp.sum())
    assert measured[3] / measured[0] == 1.5
    assert measured[1] == measured[2] == measured[0]      # reduce-scatter + all-gather = all-reduce


def test_bytes_per_parameter_of_each_stage():
    from mlmkit.estimate.memory import bytes_per_parameter

    d = 8
    assert [bytes_per_parameter(precision="bf16", zero=z, dp=d) for z in range(4)] == [18, 6 + 12 / d, 2 + 16 / d, 18 / d]
    assert [bytes_per_parameter(precision="fp32", zero=z, dp=d) for z in range(4)] == [16, 8 + 12 / d, 4 + 16 / d, 16 / d]
    assert bytes_per_parameter(precision="bf16", zero1=True, dp=d) == bytes_per_parameter(precision="bf16", zero=1, dp=d)
