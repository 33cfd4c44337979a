"""The GPT training step at tp=pp=dp=1: mlmkit's Trainer against the same model in plain PyTorch.

Plain side: nn.Linear / nn.LayerNorm / nn.Embedding with the same weights (copied from mlmkit's
model), F.cross_entropy, torch.optim.AdamW, clip_grad_norm_. mlmkit side: ``Trainer.train_step()``
(schedule executor, optimizer wrapper, metrics), tracing off (its cost is measured separately).
One thread, steps alternated, medians and the median of paired ratios.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Row, alternate, paired
from mlmkit.distributed import ProcessGroups
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import Trainer


class PlainBlock(nn.Module):
    def __init__(self, h, a, ffn):
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):                                    # [s, b, h]
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, self.a, 3, h // self.a).permute(3, 1, 2, 0, 4)
        att = (q @ k.transpose(-1, -2) / math.sqrt(h // self.a))
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Parameter(torch.zeros(cfg.seq_len, cfg.hidden))
        self.blocks = nn.ModuleList(PlainBlock(cfg.hidden, cfg.heads, cfg.ffn) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)

    def forward(self, tokens, targets):                    # [b, s]
        x = (self.wte(tokens) + self.wpe[: tokens.shape[1]]).transpose(0, 1)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)      # tied head, [s, b, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1))


def _copy_weights(plain: PlainGPT, trainer: Trainer) -> None:
    src = dict(trainer.named_parameters())
    with torch.no_grad():
        plain.wte.weight.copy_(src["embedding.weight"])
        plain.wpe.copy_(src["position"])
        for i, blk in enumerate(plain.blocks):
            for a, b in (("ln1", "ln1"), ("ln2", "ln2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
                         ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                getattr(blk, a).weight.copy_(src[f"layers.{i}.{b}.weight"])
                getattr(blk, a).bias.copy_(src[f"layers.{i}.{b}.bias"])
        plain.ln_f.weight.copy_(src["final_ln.weight"])
        plain.ln_f.bias.copy_(src["final_ln.bias"])


def run(quick: bool = False) -> list[Row]:
    torch.set_num_threads(1)
    model = GPTConfig(vocab_size=256, seq_len=128, hidden=256, heads=8, layers=4)
    cfg = TrainConfig(model=model, micro_batch_size=8, global_batch_size=8, tracing=False, max_steps=1000)
    trainer = Trainer(cfg, groups=ProcessGroups.single())
    plain = PlainGPT(model)
    _copy_weights(plain, trainer)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    tokens, targets = trainer.data.batch(0, cfg.global_batch_size)
    first_plain = plain(tokens, targets).item()
    first_ours = trainer.train_step()["loss"]
    assert abs(first_plain - first_ours) < 1e-4, (first_plain, first_ours)

    def step_plain():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = plain(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)
        opt.step()
        return time.perf_counter() - t0

    def step_ours():
        t0 = time.perf_counter()
        trainer.train_step()
        return time.perf_counter() - t0

    ours, base = alternate(step_ours, step_plain, 8 if quick else 25)
    o, b, ratio = paired(ours, base)
    return [Row("GPT train step vs plain PyTorch", "tp=pp=dp=1, h=256, 4 layers, b=8, s=128, 1 thread",
                o * 1e3, b * 1e3, "ms", "<= 1.05", ratio <= 1.05, ratio=ratio)]
