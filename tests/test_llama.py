"""Llama-style models (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied
embeddings) in every layout of the parity suite, in fp32 and in bf16 mixed precision, against the
serial model: losses of 3 steps, every gradient of the first step, every parameter after 3 steps."""

import pytest
import torch

from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import gather_full
from mlmkit.model.config import llama_config
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import Trainer

from parity_helpers import bf16_params_close, first_step_gradients

MODEL = llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4, ffn_hidden=64)
BASE = TrainConfig(model=MODEL, micro_batch_size=2, global_batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=1,
                   max_steps=5, grad_clip=1.0, weight_decay=0.01)
STEPS = 3

# Every axis and option of the parity suite, folded into six runs: tp 2 and 4 (4 > kv_heads=2: key/value
# heads replicated), pp with every schedule, dp, sequence parallelism, both recomputations, ZeRO 1-3, both
# communication paths. ZeRO-2/3 reduce each layer's gradient during the backward, so the replicated
# key/value heads' gradients are summed over tp there: tp4 with ZeRO-3 checks that (the first step's
# gradients are shards then; the losses and the parameters after 3 steps are compared).
LAYOUTS = {
    "tp2-pp2-dp2-1f1b-sp-zero2": dict(tp=2, pp=2, dp=2, sequence_parallel=True, zero=2),
    "tp4-pp2-interleaved-selective": dict(tp=4, pp=2, schedule="interleaved-1f1b", chunks=2, recompute="selective"),
    "tp2-pp2-gpipe-full": dict(tp=2, pp=2, schedule="gpipe", recompute="full"),
    "pp2-dp2-zbh1-batched": dict(pp=2, dp=2, schedule="zb-h1", batch_p2p=True),
    "tp4-dp2-sp-zero1": dict(tp=4, dp=2, sequence_parallel=True, zero1=True),
    "tp4-dp2-zero3-prefetch": dict(tp=4, dp=2, zero=3, prefetch=1),
}
# bf16 tolerance. bf16 keeps 8 bits of mantissa (relative spacing 2^-8 = 0.4%). Splitting a matmul over
# ranks changes where bf16 rounding happens, so layouts agree to bf16's noise, not bit for bit:
# - each loss within 1% of the serial bf16 run's;
# - each first-step gradient within 2% (relative L2 norm of the difference);
# - each parameter after 3 AdamW steps within three times bf16's own error (the distance between the
#   serial bf16 and the serial fp32 runs), or within 2% of its norm: parity_helpers.bf16_params_close.
BF16_LOSS_RTOL, BF16_TENSOR_RTOL = 1e-2, 2e-2
FP32_TOL = 1e-5


def _global_grads(trainer) -> dict:
    """Every gradient of this rank's chunks, gathered over tp and averaged over dp (full shapes)."""
    out = {}
    for chunk in trainer.chunks:
        out.update(gather_full(chunk, grads=True))
    dp = trainer.groups.dp
    for g in out.values():
        dp.all_reduce(g, site="test")
        g.div_(dp.size)
    return out


def _run(rank, world_size, cfg_dict):
    cfg, groups, trainer = first_step_gradients(world_size, cfg_dict)
    grads = _global_grads(trainer) if cfg.zero < 2 else None     # ZeRO-2/3: each rank holds shards
    losses = [trainer.finish_step()["loss"]]
    losses += [trainer.train_step()["loss"] for _ in range(STEPS - 1)]
    params = {}
    with trainer.full_parameters():
        for chunk in trainer.chunks:
            params.update({n: t.clone() for n, t in gather_full(chunk).items()})
    keep = groups.coords.tp == 0 and groups.coords.dp == 0
    return {"losses": losses, "grads": grads if keep else {}, "params": params if keep else {}}


_SERIAL = {}


def _serial(precision):
    if precision not in _SERIAL:
        _SERIAL[precision] = _run(0, 1, BASE.replace(precision=precision).to_dict())
    return _SERIAL[precision]


def _close(a: torch.Tensor, b: torch.Tensor, precision: str) -> bool:
    a, b = a.double(), b.double()
    if precision == "fp32":
        return (a - b).abs().max().item() <= FP32_TOL
    return (a - b).norm().item() <= BF16_TENSOR_RTOL * b.norm().item() + 1e-12


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_layout_matches_serial(layout, precision):
    cfg = BASE.replace(precision=precision, **LAYOUTS[layout])
    results = run_ranks(_run, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300)
    ref = _serial(precision)
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            tol = FP32_TOL * abs(want) if precision == "fp32" else BF16_LOSS_RTOL * abs(want)
            assert abs(got - want) <= tol, (layout, precision, r["losses"], ref["losses"])
    for kind in ("grads", "params") if cfg.zero < 2 else ("params",):
        merged = {}
        for r in results:
            merged.update(r[kind])
        assert set(merged) == set(ref[kind]), set(merged) ^ set(ref[kind])
        if precision == "bf16" and kind == "params":     # against bf16's own error (parity_helpers)
            bad = [n for n in merged if not bf16_params_close(merged[n], ref[kind][n], _serial("fp32")[kind][n],
                                                          tp=cfg.tp)]
        else:
            bad = [n for n in merged if not _close(merged[n], ref[kind][n], precision)]
        assert not bad, (layout, precision, kind, bad[:5])
    assert ref["losses"][-1] < ref["losses"][0]


def test_bf16_training_ends_near_fp32():
    # 200 steps of the quickstart model, serial: mixed precision ends within 2% of fp32 (the mean loss of
    # the last 10 steps, to average out the noise of single small batches). 200, not fewer: without fp32
    # master weights (the bf16 parameters rounded after every update) this run ends 2.3% above fp32 and
    # fails, while at 100 steps it ends within 2% and passed (tests/test_zero.py checks the masters
    # directly: test_updates_below_bf16_resolution_accumulate_in_the_fp32_masters).
    from mlmkit.train import demo_config

    ends = {}
    for precision in ("fp32", "bf16"):
        cfg = demo_config(tp=1, pp=1, max_steps=200, precision=precision, tracing=False)
        trainer = Trainer(cfg, groups=ProcessGroups.single())
        losses = trainer.fit(200, progress=False).loss
        assert losses.iloc[-10:].mean() < losses.iloc[:10].mean() - 1.0        # it learns
        ends[precision] = losses.iloc[-10:].mean()
    assert abs(ends["bf16"] - ends["fp32"]) <= 0.02 * ends["fp32"], ends
    assert all(p.dtype == torch.bfloat16 for _, p in trainer.named_parameters())
    assert all(p.main_grad.dtype == torch.float32 for _, p in trainer.named_parameters())


def test_cli_flags_for_the_new_options(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--arch", "llama", "--kv-heads", "1", "--precision",
                          "bf16", "--recompute", "--recompute-granularity", "selective", "--tp", "1", "--pp", "1",
                          "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rmsnorm/swiglu/rope, heads=4 kv_heads=1, precision=bf16, recompute=selective" in out.stdout
    assert len([json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]) == 2
    bad = subprocess.run([sys.executable, "-m", "mlmkit.train", "--recompute-granularity", "full"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--recompute-granularity needs --recompute" in bad.stderr
