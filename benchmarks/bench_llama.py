"""A Llama-style training step at tp=pp=dp=1 against the same model in plain PyTorch, and bf16 against
fp32 on this machine.

Plain side: :class:`mlmkit.model.reference.PlainTransformer` (nn.Linear, nn.RMSNorm, SDPA with GQA,
SwiGLU, rotary positions) with the weights of mlmkit's model, F.cross_entropy, torch.optim.AdamW,
clip_grad_norm_. mlmkit side: ``Trainer.train_step()``, tracing off. One thread, steps alternated,
medians and the median of paired ratios. The bf16 row is mlmkit's step in mixed precision (bf16
compute, fp32 gradients, master weights and Adam) over the same step in fp32: reported (what bf16
buys depends on the processor's bf16 support).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Row, alternate, paired
from mlmkit.distributed import ProcessGroups
from mlmkit.model.config import llama_config
from mlmkit.model.reference import PlainTransformer
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import Trainer

MODEL = llama_config(seq_len=128, hidden=256, heads=8, kv_heads=2, layers=4, ffn_hidden=688)


def _trainer(precision: str) -> Trainer:
    cfg = TrainConfig(model=MODEL, micro_batch_size=8, global_batch_size=8, tracing=False, max_steps=1000,
                      precision=precision)
    return Trainer(cfg, groups=ProcessGroups.single())


def _timer(fn):
    def timed():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def run(quick: bool = False) -> list[Row]:
    torch.set_num_threads(1)
    reps = 8 if quick else 25
    trainer = _trainer("fp32")
    cfg = trainer.config
    plain = PlainTransformer(MODEL).load_mlmkit({n: p.detach() for n, p in trainer.named_parameters()})
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    tokens, targets = trainer.data.batch(0, cfg.global_batch_size)
    first_plain = plain(tokens, targets).item()
    first_ours = trainer.train_step()["loss"]
    assert abs(first_plain - first_ours) < 1e-4, (first_plain, first_ours)

    def step_plain():
        opt.zero_grad()
        loss = plain(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)
        opt.step()

    ours, base = alternate(_timer(trainer.train_step), _timer(step_plain), reps)
    o, b, ratio = paired(ours, base)
    rows = [Row("Llama-style train step vs plain PyTorch",
                "tp=pp=dp=1, h=256, 8 heads / 2 KV, SwiGLU 688, RoPE, RMSNorm, 4 layers, b=8, s=128, 1 thread",
                o * 1e3, b * 1e3, "ms", "<= 1.05", ratio <= 1.05, ratio=ratio)]
    bf16 = _trainer("bf16")
    bf16.train_step()
    ours, base = alternate(_timer(bf16.train_step), _timer(trainer.train_step), reps)
    o, b, ratio = paired(ours, base)
    rows.append(Row("bf16 vs fp32 train step (mlmkit)", "the Llama-style step above, mixed precision vs fp32",
                    o * 1e3, b * 1e3, "ms", "n/a (reported)", None, ratio=ratio))
    return rows
