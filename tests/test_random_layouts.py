"""Random layouts against the serial model: a sweep of the whole configuration space, beside the
hand-picked parity tests (which each hold a few axes together on purpose).

Each seed draws a model (2 to 8 layers, so pipeline stages are uneven where pp x chunks does not divide
them; GPT-2 or Llama blocks, grouped- or multi-query attention, untied or padded
vocabularies, unfused SwiGLU, RoPE, mixtures of experts with their auxiliary losses, shared expert,
Switch routing, a capacity) and a layout (tp, pp with every schedule and chunk count or, one pipelined
layout in four, a random valid order read from a schedule file, dp, cp with
both splits, ep and expert tp, sequence parallelism, both recomputations, ZeRO 0-3 with prefetch,
kept parameters and small buckets, both point-to-point paths, both loss normalisations, 1 to 8
microbatches per rank), retrying until the draw is a valid config. One run per seed then checks:

- that every rank ran its schedule's compute actions in their order;
- the losses and gradient norms of 3 steps, the first step's gradients (ZeRO 0-1) and the
  parameters after 3 steps against the serial trainer's (fp32 tolerance);
- the memory of every kind and the bytes on every axis of the traced second step against the
  estimator's, exactly (mixtures of experts when their routing is forced even, which the estimator
  assumes);
- a checkpoint saved after step 2 and loaded in another random layout of the same model: its third
  step against the serial third step (loss and parameters).

Set ``MLMKIT_RANDOM_LAYOUTS`` to sweep more: ``N`` runs seeds 0..N-1, ``A:B`` seeds A..B-1, ``A,B,C``
those (the default, 5 seeds, keeps the suite's time). A failing seed names itself in the test id;
reproduce it with ``MLMKIT_RANDOM_LAYOUTS=<seed>:<seed+1> pytest tests/test_random_layouts.py``.

The same draws also run in bf16 mixed precision (``MLMKIT_RANDOM_BF16_LAYOUTS``, same syntax; by
default seeds 1001, 1005 and 1025), with Adam's eps 1e-3, held to bf16's tolerance against the
serial bf16 run (losses within 1%; first-step gradients and parameters within bf16's own error,
the serial bf16 run's distance from a serial fp32 run) and to the estimator exactly.

Not drawn, on purpose: dropout (masks depend on the layout, as in Megatron-LM: no serial equality
to check), a capacity together with sequence or context parallelism (per-rank capacities drop other
tokens than the serial model, as documented on ``GPTConfig.moe_capacity_factor``), and forced even
routing together with them (it numbers each rank's own tokens: ``GPTConfig.moe_force_uniform``).
"""

import random
from pathlib import Path

import pytest
import torch

from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.estimate import estimate_train_comm, estimate_train_memory
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.model import GPTConfig, gather_full
from mlmkit.pipeline import to_torch_csv
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.checkpoint import load_checkpoint, save_checkpoint
from mlmkit.train.trainer import Trainer

from parity_helpers import bf16_params_close, first_step_gradients, one_copy, reduced_gradients
from random_schedules import random_schedule, seeds_from_env

STEPS = 3
LOSS_RTOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-5, 5e-5
# bf16: losses within 1% (test_llama's), first-step gradients and parameters within 2% of their norm or
# three times bf16's own error (parity_helpers.bf16_params_close).
BF16_LOSS_RTOL = 1e-2
# Routed experts and their router: rounding sends a token to another expert here or there, in the layout
# and in the serial bf16 run alike, each in other experts: the serial bf16 run's expert gradients sat 4-8%
# from fp32's in one expert (seed 1062) and the layout's 7.4% from serial bf16's in another, the same
# layout in fp32 exact to 1e-7. Those tensors are held within 25% of their norm (a reduction left out
# or counted twice moves them by 50-100%).
BF16_ROUTED_RTOL = 0.25
# The bf16 sweep's seeds (other draws than the fp32 sweep's defaults; ``N``, ``A:B`` or ``A,B,C``): by
# default a mixture of experts over ep=4 (GPipe), tp=4 x cp=2 with ZeRO-3, and zb-v with tp=4 and ZeRO-1.
BF16_ENV, BF16_DEFAULT = "MLMKIT_RANDOM_BF16_LAYOUTS", "1001,1005,1025"
# The share of pipelined layouts that run a random order from a schedule file (TrainConfig.schedule).
FILE_SCHEDULES = 0.25
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "ep", "expert_tp", "cp_split", "schedule", "chunks", "microbatch_group",
               "sequence_parallel", "recompute", "zero", "prefetch", "reshard_after_forward", "bucket_bytes",
               "batch_p2p")


# ------------------------------------------------------------------------------------------ draws
def _model(rng: random.Random) -> dict:
    m = dict(vocab_size=rng.choice([256, 300]), seq_len=rng.choice([16, 32]), hidden=32, heads=4,
             layers=rng.choice([2, 3, 4, 5, 6, 8]))
    kind = rng.choice(["gpt2", "llama", "gqa", "mqa", "untied", "swiglu-unfused", "rope", "moe", "moe", "moe-llama"])
    llama = dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=64, position="rope", bias=False, tie_embeddings=False)
    m.update({"llama": {**llama, "kv_heads": 2}, "gqa": dict(kv_heads=2), "mqa": dict(kv_heads=1),
              "untied": dict(tie_embeddings=False, bias=rng.random() < 0.5),
              "swiglu-unfused": dict(mlp="swiglu", ffn_hidden=48, gate_up_fused=False),
              "rope": dict(position="rope"), "moe-llama": llama}.get(kind, {}))
    if kind.startswith("moe"):
        k = rng.choice([1, 2])
        m.update(experts=rng.choice([2, 4]), top_k=k, moe_renormalize=k > 1, moe_router=rng.choice(["softmax", "sigmoid"]),
                 moe_aux_loss_coeff=rng.choice([0.0, 0.01]), moe_z_loss_coeff=rng.choice([0.0, 0.001]),
                 moe_force_uniform=rng.random() < 0.5)
        if rng.random() < 0.3:
            m["moe_shared_ffn_hidden"] = 32
        if rng.random() < 0.3:
            m.update(moe_capacity_factor=rng.choice([0.5, 1.0, 1.5]), moe_drop_policy=rng.choice(["probs", "position"]))
    if rng.random() < 0.2:
        m["make_vocab_size_divisible_by"] = rng.choice([8, 128])
    return m


def _layout(rng: random.Random, model: GPTConfig, *, global_batch_size=None, micro_batch_size=None) -> dict:
    tp, pp, cp, dp = rng.choice([1, 1, 2, 4]), rng.choice([1, 2, 2, 4]), rng.choice([1, 1, 2]), rng.choice([1, 2, 4])
    while tp * pp * cp * dp > 8:
        if dp > 1:
            dp //= 2
        else:
            pp //= 2
    schedule = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"]) if pp > 1 else "1f1b"
    chunks = {"zb-v": 2, "dualpipev": 2, "interleaved-1f1b": rng.choice([2, 4])}.get(schedule, 1)
    t = dict(tp=tp, pp=pp, dp=dp, cp=cp, schedule=schedule, chunks=chunks, cp_split=rng.choice(["balanced", "naive"]),
             sequence_parallel=tp > 1 and (model.experts > 0 or rng.random() < 0.5),
             recompute=rng.choice(["none", "none", "selective", "full"]), batch_p2p=rng.choice([None, True, False]),
             bucket_bytes=rng.choice([25 * 2**20, 4096]))
    if schedule == "interleaved-1f1b" and rng.random() < 0.3:
        t["microbatch_group"] = 2 * pp
    if model.experts:
        t["ep"] = rng.choice([1, 2, 4])
        if tp > 1 and rng.random() < 0.5:
            t["expert_tp"] = tp
        t["zero"] = rng.choice([0, 1])
    else:
        t["zero"] = rng.choice([0, 0, 1, 2, 3])
        if t["zero"] == 3:
            t.update(prefetch=rng.choice([0, 1]), reshard_after_forward=rng.random() < 0.7)
    mbs = micro_batch_size or rng.choice([1, 2, 4])
    t["micro_batch_size"] = mbs
    t["global_batch_size"] = global_batch_size or mbs * dp * rng.choice([1, 2, 3, 4, 5, 8])
    return t


def _valid(model: dict, layout: dict, training: dict):
    try:
        cfg = TrainConfig(model=GPTConfig(**model), **layout, **training)
    except ValueError:
        return None
    m = cfg.model
    if (m.moe_capacity_factor is not None or m.moe_force_uniform) and (cfg.cp > 1 or cfg.sequence_parallel):
        return None                       # per-rank capacities and forced routes: other tokens than serial's
    return cfg


def _schedule_file(cfg: TrainConfig, rng: random.Random, path) -> TrainConfig:
    """``cfg`` running a random valid order of its pipeline (any order the validator accepts, B or I+W
    per microbatch and stage, forward- to backward-eager) from a CSV file in torch's format written
    at ``path``, in place of its named schedule."""
    order = random_schedule(rng.randrange(2**31), stages=cfg.pp, microbatches=cfg.microbatches, chunks=cfg.chunks,
                            placement=cfg.placement, split=rng.choice([0.0, 0.5, 1.0]),
                            eager=rng.choice([0.2, 0.5, 0.8]), last_in_order=True)
    to_torch_csv(order, str(path), format=rng.choice(["compute_only", "compute_comms"]))
    return cfg.replace(schedule=str(path), microbatch_group=None)


def draw(seed: int, directory) -> tuple[TrainConfig, TrainConfig]:
    """Seed -> (layout A, layout B): two valid configs of one model and one batch, A on 2+ ranks.
    A pipelined layout runs, one time in four, a random order of its own read from a schedule file
    written into ``directory`` (drawn by a generator of its own: the other draws stay the seed's)."""
    a, b = _draw_named(seed)
    files = random.Random(seed + 10**6)
    if a.pp > 1 and files.random() < FILE_SCHEDULES:
        a = _schedule_file(a, files, Path(directory) / f"seed{seed}-a.csv")
    if b.pp > 1 and files.random() < FILE_SCHEDULES:
        b = _schedule_file(b, files, Path(directory) / f"seed{seed}-b.csv")
    return a, b


def _draw_named(seed: int) -> tuple[TrainConfig, TrainConfig]:
    rng = random.Random(seed)
    for _ in range(1000):
        model = _model(rng)
        training = dict(lr=3e-3, min_lr=3e-4, warmup_steps=1, max_steps=5, weight_decay=0.01, eps=1e-6,
                        grad_clip=rng.choice([0.0, 1.0, 0.05]), per_token_loss=rng.random() < 0.7)
        try:
            gpt = GPTConfig(**model)
        except ValueError:
            continue
        a = _valid(model, _layout(rng, gpt), training)
        if a is None or a.world_size == 1:
            continue
        for _ in range(100):
            # The auxiliary losses and the capacity are per microbatch: B keeps A's micro-batch size.
            b = _valid(model, _layout(rng, gpt, global_batch_size=a.global_batch_size,
                                      micro_batch_size=a.micro_batch_size if gpt.experts else None), training)
            if b is not None:
                return a, b
    raise AssertionError(f"seed {seed}: no valid draw in 1000 tries")


def _serial_config(cfg: TrainConfig) -> TrainConfig:
    return cfg.replace(**{k: TrainConfig.__dataclass_fields__[k].default for k in LAYOUT_KEYS})


# ------------------------------------------------------------------------------------------- ranks
def _params(trainer, groups, cfg) -> dict:
    params = {}
    with trainer.full_parameters():
        for chunk in trainer.chunks:
            params.update({n: t.clone() for n, t in gather_full(chunk).items()})
    return one_copy(cfg, groups, trainer, params)


def _run_a(rank, world_size, cfg_dict, directory):
    """3 steps: the first step's gradients (before the optimizer), the second traced, a checkpoint
    after it."""
    cfg, groups, trainer = first_step_gradients(world_size, cfg_dict)
    # ZeRO-2/3 keep only a shard of each reduced gradient
    grads = reduced_gradients(cfg, groups, trainer) if cfg.zero < 2 else {}
    rows = [trainer.finish_step()]
    trainer.clear_traces()
    rows.append(trainer.train_step())
    traces = trainer.traces() if world_size > 1 else None
    if directory:
        save_checkpoint(trainer, directory)
    rows.append(trainer.train_step())
    return {"losses": [r["loss"] for r in rows], "norms": [r["grad_norm"] for r in rows],
            "grads": one_copy(cfg, groups, trainer, grads), "params": _params(trainer, groups, cfg), "traces": traces}


def _run_b(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single()
    trainer = Trainer(cfg, groups=groups)
    step = load_checkpoint(trainer, directory)
    loss = trainer.train_step()["loss"]
    return {"step": step, "loss": loss, "params": _params(trainer, groups, cfg)}


def _describe(cfg: TrainConfig) -> str:
    model = {k: v for k, v in cfg.model.to_dict().items() if v != GPTConfig.__dataclass_fields__[k].default}
    layout = {k: getattr(cfg, k) for k in LAYOUT_KEYS + ("micro_batch_size", "global_batch_size", "per_token_loss",
                                                         "grad_clip")}
    return f"model {model}, {layout}"


def _merged(results, kind) -> dict:
    out = {}
    for r in results:
        out.update(r[kind])
    return out


def _held_to(got: dict, want: dict) -> dict:
    """``want`` with what ``got`` is held to: a tied head on the last pipeline stage (``head_weight``,
    which the serial model does not have) is held to the serial embedding: after the embedding group's
    reduction its gradient and its weights are the embedding's."""
    if "head_weight" in got and "head_weight" not in want:
        want = {**want, "head_weight": want["embedding.weight"]}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return want


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest difference of any element, and where."""
    want = _held_to(got, want)
    return max(((got[n].double() - want[n].double()).abs().max().item(), n) for n in want)


def _fp32_close(got: dict, want: dict, tol: float) -> tuple[bool, str]:
    worst = _worst(got, want)
    return worst[0] <= tol, f"largest difference {worst[0]:.3g} at {worst[1]}"


def _bf16_close(got: dict, want: dict, exact: dict, *, tp: int) -> tuple[bool, str]:
    """bf16 tensors against the serial bf16 run's (``want``), within bf16's own error, the distance
    from ``want`` to the serial fp32 run's ``exact`` (parity_helpers.bf16_params_close); routed experts
    and their router within :data:`BF16_ROUTED_RTOL` of their norm."""
    want, exact = _held_to(got, want), _held_to(got, exact)

    def close(n):
        if ".mlp.experts." in n or ".mlp.router." in n:
            rtol = BF16_ROUTED_RTOL * want[n].double().norm().item()
            if (got[n].double() - want[n].double()).norm().item() <= rtol:
                return True
        return bf16_params_close(got[n], want[n], exact[n], tp=tp)

    bad = [n for n in want if not close(n)]
    return not bad, f"outside bf16's tolerance: {bad[:5]}"


def _check_layout(a: TrainConfig, b: TrainConfig, tmp_path, where: str) -> None:
    """Layout A's three steps against the serial run, its traced second step against the estimator,
    and its checkpoint resumed in layout B; fp32 to fp32's tolerance, bf16 to bf16's."""
    bf16 = a.precision == "bf16"
    ref = _run_a(0, 1, _serial_config(a).to_dict(), None)
    exact = _run_a(0, 1, _serial_config(a).replace(precision="fp32").to_dict(), None) if bf16 else ref
    loss_rtol = BF16_LOSS_RTOL if bf16 else LOSS_RTOL
    tp = max(a.tp, a.expert_tp, b.tp, b.expert_tp)

    def grads_close(got, want):
        return _bf16_close(got, want, exact["grads"], tp=tp) if bf16 else _fp32_close(got, want, GRAD_TOL)

    def params_close(got, want):
        return _bf16_close(got, want, exact["params"], tp=tp) if bf16 else _fp32_close(got, want, PARAM_TOL)

    directory = str(tmp_path / "ckpt")
    got = run_ranks(_run_a, world_size=a.world_size, args=(a.to_dict(), directory), timeout_s=300)
    for r in got:
        for x, y, what in zip(r["losses"] + r["norms"], ref["losses"] + ref["norms"],
                              ["loss"] * STEPS + ["grad norm"] * STEPS):
            assert abs(x - y) <= loss_rtol * abs(y) + 1e-7, (where, what, r["losses"], ref["losses"], r["norms"],
                                                            ref["norms"])
    if a.zero < 2:
        ok, why = grads_close(_merged(got, "grads"), ref["grads"])
        assert ok, (where, "gradients", why)
    ok, why = params_close(_merged(got, "params"), ref["params"])
    assert ok, (where, "parameters", why)

    # Every rank ran its schedule's compute actions in their order (a schedule file's, not a generator's).
    traces = merge_traces([r["traces"] for r in got])
    events = traces["events"]
    order = a.pipeline_schedule()
    for rank in range(a.world_size):
        ran = events[(events["rank"] == rank) & events["action"].isin(list("FBIW"))].sort_values("start")
        want = [(x.kind, x.microbatch, x.chunk) for x in order.compute_actions(a.topology.coords(rank).pp)]
        assert list(zip(ran["action"], ran["microbatch"], ran["chunk"])) == want, (where, "order of rank", rank)

    # The traced second step against the estimator (even routing: what the estimator assumes), exactly
    # in either precision.
    if not a.model.experts or a.model.moe_force_uniform:
        memory = compare_memory(traces["memory"], estimate_train_memory(a))
        assert (memory.measured == memory.estimated).all(), (where, memory[memory.measured != memory.estimated])
        comm = compare_comm(traces["comm"], estimate_train_comm(a))
        assert (comm.measured == comm.estimated).all(), (where, comm[comm.measured != comm.estimated])

    # The checkpoint of step 2, resumed in layout B: step 3 as the serial run's.
    resumed = run_ranks(_run_b, world_size=b.world_size, args=(b.to_dict(), directory), timeout_s=300)
    for r in resumed:
        assert r["step"] == 2, where
        assert abs(r["loss"] - ref["losses"][2]) <= loss_rtol * abs(ref["losses"][2]), (where, r["loss"], ref["losses"])
    ok, why = params_close(_merged(resumed, "params"), ref["params"])
    assert ok, (where, "resumed", why)


@pytest.mark.parametrize("seed", seeds_from_env("MLMKIT_RANDOM_LAYOUTS", "5"))
def test_a_random_layout_trains_estimates_and_resumes_as_serial(seed, tmp_path):
    a, b = draw(seed, tmp_path)
    _check_layout(a, b, tmp_path, f"seed {seed}\n  A: {_describe(a)}\n  B: {_describe(b)}")


@pytest.mark.parametrize("seed", seeds_from_env(BF16_ENV, BF16_DEFAULT))
def test_a_random_layout_in_bf16_trains_estimates_and_resumes_as_serial(seed, tmp_path):
    # The same draws in bf16 mixed precision (bf16 parameters and activations, fp32 gradients and
    # master weights), held to bf16's tolerance: losses within 1%, first-step gradients and parameters
    # within bf16's own error; the estimator still exactly.
    # Adam's eps 1e-3, not the fp32 sweep's 1e-6: with a tiny eps its first updates are lr * sign(g), so
    # rounding noise on a near-zero gradient (a zero-initialised bias) flips a whole step of the update
    # and the parameters stop being a witness (seed 1028: fc2's bias 23x bf16's own error after 3 steps,
    # its first gradient within 0.2% of serial bf16's, the same layout in fp32 exact to 1e-7).
    a, b = (c.replace(precision="bf16", eps=1e-3) for c in draw(seed, tmp_path))
    _check_layout(a, b, tmp_path, f"seed {seed} (bf16)\n  A: {_describe(a)}\n  B: {_describe(b)}")


def test_the_draws_cover_every_axis(tmp_path):
    # The sweep is only as good as what it draws: over the first 200 seeds (drawing only, no run),
    # every schedule, ZeRO stage, recomputation and parallel axis appears, with and without experts,
    # and schedule files of loops of one and more chunks and of Vs, with fused and split backwards.
    seen = set()
    for seed in range(200):
        a, b = draw(seed, tmp_path)
        for c in (a, b):
            if c.schedule_file:
                order = c.pipeline_schedule()
                seen |= {("file", c.placement, c.chunks > 1), ("file split backward", order.split_backward),
                         ("file zero", c.zero), ("file recompute", c.recompute)}
            seen |= {("schedule", "file" if c.schedule_file else c.schedule), ("zero", c.zero), ("recompute", c.recompute),
                     ("tp", c.tp > 1), ("pp", c.pp > 1), ("dp", c.dp > 1), ("cp", c.cp > 1), ("ep", c.ep > 1),
                     ("expert_tp", c.expert_tp > 1), ("sp", c.sequence_parallel), ("experts", c.model.experts > 0),
                     ("capacity", c.model.moe_capacity_factor is not None), ("batch_p2p", c.batch_p2p),
                     ("prefetch", c.prefetch), ("padded", c.model.padded_vocab(c.tp) != c.model.vocab_size),
                     ("uneven stages", c.model.layers % (c.pp * c.chunks) != 0)}
    want = ({("schedule", s) for s in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev")}
            | {("zero", z) for z in range(4)} | {("recompute", r) for r in ("none", "selective", "full")}
            | {(axis, True) for axis in ("tp", "pp", "dp", "cp", "ep", "expert_tp", "sp", "experts", "capacity",
                                         "padded", "uneven stages")}
            | {("batch_p2p", v) for v in (None, True, False)} | {("prefetch", 1)}
            | {("schedule", "file"), ("file", "loop", False), ("file", "loop", True), ("file", "v", True)}
            | {("file split backward", s) for s in (False, True)} | {("file zero", z) for z in range(4)}
            | {("file recompute", r) for r in ("none", "selective", "full")})
    assert want <= seen, sorted(want - seen)
