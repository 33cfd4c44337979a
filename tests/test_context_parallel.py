"""Context parallelism: ring attention against scaled_dot_product_attention, training in every layout
of the parity suite with cp against the serial model (GPT-2 and Llama blocks), the split's work
balance, traces and estimator, bad input."""

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mlmkit import Topology
from mlmkit.context_parallel import Ring, attention_work, held_positions, ring_attention, ring_steps, simulate_ring
from mlmkit.context_parallel.ring import allgather_attention
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.estimate import estimate_train_comm, estimate_train_memory
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.model import GPTConfig, gather_full
from mlmkit.model.config import llama_config
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import traced_step

from parity_helpers import bf16_params_close, first_step_gradients

GPT2 = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4)
LLAMA = llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4, ffn_hidden=64)
MODELS = {"gpt": GPT2, "llama": LLAMA}
STEPS = 3
FP32_TOL = 1e-5
# Parameters after 3 AdamW steps: the update divides by sqrt(v) + eps (eps = 1e-8), so an element whose
# gradient is near zero turns a 1e-8 rounding difference of its gradient (a different summation order in
# the ring's blocks) into up to lr * 1e-8 / eps of parameter. Losses and first-step gradients are held to
# 1e-5; parameters to 5e-5, still far below the ~lr = 3e-3 that a wrong gradient moves a parameter by.
PARAM_TOL = 5e-5
BF16_LOSS_RTOL, BF16_TENSOR_RTOL = 1e-2, 2e-2     # as tests/test_llama.py (bf16's noise, explained there)


# ------------------------------------------------------------------------------- ring attention alone
def _ring_vs_sdpa(rank, world_size):
    """Every split and key/value head count: this rank's output and gradients against SDPA on the
    full sequence, and the (query, key) pairs the ring computed."""
    groups = ProcessGroups.build(Topology(cp=world_size))
    out = []
    for split in ("balanced", "naive"):
        for kv_heads in (4, 2, 1):
            torch.manual_seed(kv_heads)
            b, a, s, d = 2, 4, 16, 8
            q = torch.randn(b, a, s, d, requires_grad=True)
            k = torch.randn(b, kv_heads, s, d, requires_grad=True)
            v = torch.randn(b, kv_heads, s, d, requires_grad=True)
            grad = torch.randn(b, a, s, d)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != a)
            ref.backward(grad)
            pos = torch.tensor(held_positions(s, world_size, groups.cp.rank, split))
            for variant, kernel in ((ring_attention, "auto"), (ring_attention, "math"), (allgather_attention, "auto")):
                ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
                got = variant(ql, kl, vl, Ring(groups.cp, seq_len=s, split=split, kernel=kernel))
                got.backward(grad[:, :, pos])
                errors = [(got - ref[:, :, pos]).abs().max().item()]
                errors += [(mine.grad - full.grad[:, :, pos]).abs().max().item()
                           for mine, full in ((ql, q), (kl, k), (vl, v))]
                out.append((f"{variant.__name__}/{kernel}", split, kv_heads, errors))
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_sdpa_on_the_full_sequence(cp):
    for rank, results in enumerate(run_ranks(_ring_vs_sdpa, world_size=cp, timeout_s=120)):
        assert len(results) == 18
        for variant, split, kv_heads, errors in results:
            assert max(errors) <= FP32_TOL, (rank, variant, split, kv_heads, errors)   # output, dQ, dK, dV


@pytest.mark.parametrize("seq_len,cp", [(16, 2), (16, 4), (64, 8), (24, 3)])
def test_balanced_split_gives_every_rank_the_same_attention_work(seq_len, cp):
    work = attention_work(seq_len, cp, "balanced")
    assert len(set(work)) == 1 and sum(work) == seq_len * (seq_len + 1) // 2
    naive = attention_work(seq_len, cp, "naive")
    assert sum(naive) == sum(work) and naive == sorted(naive) and naive[-1] > naive[0]
    for r in range(cp):   # rank i holds chunks i and 2cp-1-i; every step after the first computes 2 c^2 pairs
        c = seq_len // (2 * cp)
        assert held_positions(seq_len, cp, r) == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        steps = ring_steps(seq_len, cp, r)
        assert [src for src, _ in steps] == [(r - j) % cp for j in range(cp)]
        assert all(sum(seg.pairs for seg in segs) == 2 * c * c for _, segs in steps[1:])


@pytest.mark.parametrize("call", [
    lambda: held_positions(8, 3, 0),            # 2*cp=6 chunks of 1: positions 6 and 7 were held by nobody
    lambda: ring_steps(8, 3, 1),
    lambda: attention_work(10, 4, "naive"),     # chunks of 2: the last 2 positions' work went uncounted
    lambda: simulate_ring(8, 3, "balanced", layers=1, pair_time=1e-3, message_time=1e-3),
])
def test_a_sequence_that_does_not_divide_into_the_chunks_is_refused(call):
    with pytest.raises(ValueError, match=r"context parallelism: seq_len=(8|10) is not divisible by (2\*cp=6|cp=4)"):
        call()
    for bad, needle in (((0, 2), "seq_len=0 must be an integer >= 1"), ((8, 0), "cp=0 must be an integer >= 1")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            held_positions(*bad, 0)
    from mlmkit.viz import cp_split_figure

    with pytest.raises(ValueError, match=r"seq_len=8 is not divisible by 2\*cp=6"):
        cp_split_figure(8, 3)                    # drew positions 6 and 7 as rank 0's


def test_simulated_ring_shows_the_naive_split_idle():
    import pandas as pd

    idle = {}
    for split in ("balanced", "naive"):
        df = pd.DataFrame(simulate_ring(64, 4, split, layers=3, pair_time=1e-3, message_time=0.01))
        end = df.end.max()
        idle[split] = (1 - (df.end - df.start).groupby(df["rank"]).sum() / end).tolist()
        assert df.groupby("rank").size().tolist() == [3 * 4] * 4
    assert max(idle["balanced"]) < 1e-9                       # messages hidden behind equal work
    assert idle["naive"] == sorted(idle["naive"], reverse=True) and idle["naive"][0] > 0.8 and idle["naive"][-1] < 1e-9


# ------------------------------------------------------------------------------- training parity
# Every axis and option of the parity suite, with cp: tp (and SP), pp with every schedule, dp, both
# recomputations, ZeRO-1, both communication paths, bf16; GPT-2 and Llama blocks; both splits.
LAYOUTS = {
    "gpt-cp2": dict(model="gpt", cp=2),
    "gpt-cp4": dict(model="gpt", cp=4),
    "llama-cp2": dict(model="llama", cp=2),
    "llama-cp4": dict(model="llama", cp=4),
    "gpt-cp4-naive-selective": dict(model="gpt", cp=4, cp_split="naive", recompute="selective"),
    "llama-cp2-tp2-sp": dict(model="llama", cp=2, tp=2, sequence_parallel=True),
    "gpt-cp2-tp2-dp2-zero1-full": dict(model="gpt", cp=2, tp=2, dp=2, zero1=True, recompute="full"),
    "llama-cp2-dp2-zero1": dict(model="llama", cp=2, dp=2, zero1=True),
    "gpt-cp2-pp2-1f1b-batched": dict(model="gpt", cp=2, pp=2, batch_p2p=True),
    "llama-cp2-pp2-gpipe": dict(model="llama", cp=2, pp=2, schedule="gpipe"),
    "gpt-cp2-pp2-interleaved": dict(model="gpt", cp=2, pp=2, schedule="interleaved-1f1b", chunks=2),
    "llama-cp2-pp2-zbh1": dict(model="llama", cp=2, pp=2, schedule="zb-h1"),
    "gpt-cp2-pp2-zbv": dict(model="gpt", cp=2, pp=2, schedule="zb-v", chunks=2),
    "llama-cp2-pp2-dualpipev": dict(model="llama", cp=2, pp=2, schedule="dualpipev", chunks=2),
    "llama-cp2-tp2-bf16": dict(model="llama", cp=2, tp=2, precision="bf16"),
}


def _config(model: str, **options) -> TrainConfig:
    return TrainConfig(model=MODELS[model], micro_batch_size=2, global_batch_size=8, lr=3e-3, min_lr=3e-4,
                       warmup_steps=1, max_steps=5, grad_clip=1.0, weight_decay=0.01, **options)


def _train(rank, world_size, cfg_dict):
    cfg, groups, trainer = first_step_gradients(world_size, cfg_dict)
    grads = {}
    for chunk in trainer.chunks:
        grads.update(gather_full(chunk, grads=True))
    for g in grads.values():          # each cp (and dp) rank holds its tokens' part: average as the optimizer does
        groups.dp_cp.all_reduce(g, site="test")
        g.div_(groups.dp_cp.size)
    rows = [trainer.finish_step()] + [trainer.train_step() for _ in range(STEPS - 1)]
    losses, norms = [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
    params = {}
    for chunk in trainer.chunks:
        params.update(gather_full(chunk))
    c = groups.coords
    keep = c.tp == 0 and c.dp == 0 and c.cp == 0
    return {"losses": losses, "norms": norms, "grads": grads if keep else {}, "params": params if keep else {}}


_SERIAL = {}


def _serial(model: str, precision: str) -> dict:
    if (model, precision) not in _SERIAL:
        _SERIAL[model, precision] = _train(0, 1, _config(model, precision=precision).to_dict())
    return _SERIAL[model, precision]


def _close(a, b, precision, tol=FP32_TOL) -> bool:
    a, b = a.double(), b.double()
    if precision == "fp32":
        return (a - b).abs().max().item() <= tol
    return (a - b).norm().item() <= BF16_TENSOR_RTOL * b.norm().item() + 1e-12


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_serial(layout):
    options = dict(LAYOUTS[layout])
    model = options.pop("model")
    cfg = _config(model, **options)
    precision = cfg.precision
    results = run_ranks(_train, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300)
    ref = _serial(model, precision)
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            tol = FP32_TOL * abs(want) if precision == "fp32" else BF16_LOSS_RTOL * abs(want)
            assert abs(got - want) <= tol, (layout, r["losses"], ref["losses"])
        # The global gradient norm (reported, and what clipping scales by): the cp replicas hold one
        # reduced gradient, counted once (dividing by dp alone gave the serial norm times sqrt(cp)).
        for got, want in zip(r["norms"], ref["norms"]):
            tol = FP32_TOL * abs(want) if precision == "fp32" else BF16_LOSS_RTOL * abs(want)
            assert abs(got - want) <= tol, (layout, "grad norm", r["norms"], ref["norms"])
    for kind in ("grads", "params"):
        merged = {}
        for r in results:
            merged.update(r[kind])
        if "head_weight" not in ref[kind]:
            merged.pop("head_weight", None)     # the last stage's copy of a tied embedding
        assert set(merged) == set(ref[kind]), set(merged) ^ set(ref[kind])
        if precision == "bf16" and kind == "params":     # against bf16's own error (parity_helpers)
            fp32 = _serial(model, "fp32")[kind]
            bad = [n for n in merged if not bf16_params_close(merged[n], ref[kind][n], fp32[n], tp=cfg.tp)]
        else:
            tol = FP32_TOL if kind == "grads" else PARAM_TOL
            bad = [n for n in merged if not _close(merged[n], ref[kind][n], precision, tol)]
        assert not bad, (layout, kind, bad[:5])
    assert ref["losses"][-1] < ref["losses"][0]


# ------------------------------------------------------------------------------- traces and estimator
@pytest.fixture(scope="module")
def traced():
    """One traced step at cp = 1, 2, 4 (balanced) and cp = 4 (naive) of a 32-token GPT-2 model."""
    out = {}
    model = GPTConfig(vocab_size=256, seq_len=32, hidden=32, heads=4, layers=2)
    for name, options in {"cp1": dict(cp=1), "cp2": dict(cp=2), "cp4": dict(cp=4),
                          "cp4-naive": dict(cp=4, cp_split="naive")}.items():
        cfg = TrainConfig(model=model, micro_batch_size=2, global_batch_size=4, **options)
        out[name] = cfg, merge_traces(run_ranks(traced_step, world_size=cfg.world_size, args=(cfg.to_dict(),),
                                                timeout_s=120))
    return out


def test_measured_bytes_and_memory_equal_the_estimate(traced):
    peaks = {}
    for name, (cfg, traces) in traced.items():
        if cfg.world_size > 1:           # one rank sends nothing
            comm = compare_comm(traces["comm"], estimate_train_comm(cfg))
            assert (comm.measured == comm.estimated).all(), (name, comm[comm.measured != comm.estimated])
        memory = compare_memory(traces["memory"], estimate_train_memory(cfg))
        exact = memory[memory.kind != "activations"]
        assert (exact.measured == exact.estimated).all(), (name, exact)
        acts = memory[memory.kind == "activations"]
        assert ((acts.ratio - 1).abs() <= 0.10).all(), (name, acts)
        peaks[name] = acts.measured.max()
        if cfg.cp > 1:
            assert (estimate_train_comm(cfg)["cp"] > 0).all()
    for cp in (2, 4):   # activations per rank shrink about cp times (the embedding's indices and tables do not)
        assert 1 / cp <= peaks[f"cp{cp}"] / peaks["cp1"] <= 1.10 / cp, peaks


def test_ring_steps_are_traced_with_their_work(traced):
    for name in ("cp2", "cp4", "cp4-naive"):
        cfg, traces = traced[name]
        ring = traces["ring"]
        layers, m = cfg.model.layers, cfg.microbatches
        per_rank = ring.groupby("rank").size()
        assert (per_rank == 2 * cfg.cp * layers * m).all()          # every step, forward and backward
        work = ring[ring.phase == "forward"].groupby("rank").pairs.sum() // (layers * m)
        expected = attention_work(cfg.model.seq_len, cfg.cp, cfg.cp_split)
        assert list(work) == expected, (name, list(work), expected)
        sends = traces["comm"][(traces["comm"].axis == "cp") & (traces["comm"].op == "send")]
        assert len(sends) == cfg.cp * layers * m * (2 * (cfg.cp - 1) + cfg.cp)   # fwd kv, bwd kv + dkv
    assert len(set(traced["cp4"][1]["ring"].groupby("rank").pairs.sum())) == 1
    assert len(set(traced["cp4-naive"][1]["ring"].groupby("rank").pairs.sum())) == 4


# ------------------------------------------------------------------------------- bad input, CLI
@pytest.mark.parametrize("options,needle", [
    (dict(cp=3), r"seq_len=16 is not divisible by 2\*cp=6"),
    (dict(cp=4, tp=4, sequence_parallel=True), r"seq_len=16 is not divisible by 2\*cp=8 times tp=4"),
    (dict(cp=2, model={"dropout": 0.1}), r"context parallelism \(cp=2\) needs dropout=0, got dropout=0.1"),
    (dict(cp=2, cp_split="zigzag"), r"cp_split='zigzag' must be 'balanced' or 'naive'"),
    (dict(cp=0), r"cp=0 must be >= 1"),
])
def test_bad_context_parallel_configs_fail_before_any_process(options, needle):
    base = _config("gpt")
    with pytest.raises(ValueError, match=needle):
        base.replace(**options)


def test_cli_cp_matches_the_serial_loss(tmp_path):
    def losses(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-2000:]
        return [json.loads(line)["loss"] for line in out.stdout.splitlines() if line.startswith("{")]

    serial = losses([sys.executable, "-m", "mlmkit.train", "--tp", "1", "--pp", "1", "--steps", "2"])
    cp = losses([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mlmkit.train",
                 "--tp", "1", "--pp", "1", "--cp", "2", "--steps", "2"])
    assert cp == pytest.approx(serial, abs=1e-5)
    bad = subprocess.run([sys.executable, "-m", "mlmkit.train", "--cp", "3", "--tp", "1", "--pp", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "seq_len=32 is not divisible by 2*cp=6" in bad.stderr
