"""AdamW for parallel training: replicated (plain data parallelism) or sharded over dp (ZeRO-1).

Both optimizers do, in :meth:`step`: average gradients over the dp group, clip to a global norm
counted once per element (:mod:`mlmkit.data_parallel.grads`), then an AdamW update
(Loshchilov & Hutter 2019; weight decay on every parameter).

- :class:`ReplicatedAdamW`: every dp rank all-reduces gradients (in buckets) and keeps the full
  optimizer state: 12 bytes per parameter in fp32 (master copy excluded since training is fp32:
  exp_avg and exp_avg_sq, 8 bytes, plus the gradient's 4).
- :class:`ShardedAdamW` (ZeRO stage 1, Rajbhandari et al. 2020; Megatron-LM's distributed
  optimizer): parameters are viewed as one flat vector split in ``dp`` equal contiguous shards.
  Gradients are reduce-scattered (each rank receives the average of its shard only), each rank
  updates its shard with its own slice of the optimizer state, then the updated shards are
  all-gathered into every replica's parameters. Optimizer state per rank shrinks by ``dp``.

AdamW is element-wise, so updating shards gives exactly the same numbers as updating the whole.
Both expose the state per parameter name (:meth:`state_by_name`) so checkpoints are layout-free.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from mlmkit.data_parallel.grads import allreduce_gradients, clip_grad_norm, counted_once
from mlmkit.distributed import ProcessGroups

__all__ = ["ReplicatedAdamW", "ShardedAdamW", "make_optimizer"]


class _Base:
    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], groups: ProcessGroups, *,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 1.0):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        names = [n for n, _ in self.named]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter names must be unique on a rank, got duplicates in {names}")
        self.params = [p for _, p in self.named]
        self.groups = groups
        self.hyper = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float = float("nan")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def params_loaded(self) -> None:
        """Call after the model's weights were overwritten (a checkpoint load): an optimizer that
        keeps its own copy of the weights refreshes it from the parameters."""


class ReplicatedAdamW(_Base):
    """Plain data parallelism: bucketed all-reduce of gradients, full AdamW state on every rank."""

    def __init__(self, named_params, groups: ProcessGroups, *, bucket_bytes: int = 25 * 2**20, **kw):
        super().__init__(named_params, groups, **kw)
        self.bucket_bytes = bucket_bytes
        self.opt = torch.optim.AdamW(self.params, lr=0.0, **self.hyper)

    def step(self, *, lr: float) -> float:
        """Average, clip, update. Returns the global gradient norm before clipping."""
        allreduce_gradients(self.params, self.groups.dp, bucket_bytes=self.bucket_bytes)
        self.last_grad_norm = clip_grad_norm(self.params, self.groups, max_norm=self.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return self.last_grad_norm

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        states, step = {}, 0
        for n, p in self.named:
            st = self.opt.state.get(p)
            if st:
                states[n] = {"exp_avg": st["exp_avg"].detach().clone(), "exp_avg_sq": st["exp_avg_sq"].detach().clone()}
                step = int(st["step"])
        return states, step

    def load_state_by_name(self, states: dict, step: int) -> None:
        for n, p in self.named:
            if n in states:
                self.opt.state[p] = {"step": torch.tensor(float(step)),
                                     "exp_avg": states[n]["exp_avg"].to(p).clone(),
                                     "exp_avg_sq": states[n]["exp_avg_sq"].to(p).clone()}


class ShardedAdamW(_Base):
    """ZeRO-1: optimizer state and update split across the dp group (see module docstring)."""

    def __init__(self, named_params, groups: ProcessGroups, **kw):
        super().__init__(named_params, groups, **kw)
        dp = groups.dp.size
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = -(-self.numel // dp)           # ceil(N / dp); the flat vector is zero-padded
        self.start = groups.dp.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params])
        self.shard = nn.Parameter(flat[self.start:self.start + self.shard_size].clone())
        # 1 where this element counts towards the global gradient norm, else 0 (module grads).
        counts = self._flat([torch.full_like(p, 1.0 if counted_once(p, groups) else 0.0) for p in self.params])
        self.count_mask = counts[self.start:self.start + self.shard_size]
        self.opt = torch.optim.AdamW([self.shard], lr=0.0, **self.hyper)

    def params_loaded(self) -> None:
        """Refresh the fp32 shard from the model's parameters (after a checkpoint load): the update
        writes the shard back over the parameters, so a stale shard would undo the load."""
        flat = self._flat([p.detach() for p in self.params])
        with torch.no_grad():
            self.shard.copy_(flat[self.start:self.start + self.shard_size])

    def _flat(self, tensors) -> torch.Tensor:
        # [N] -> [dp * shard_size], zero-padded at the end.
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.shard_size * self.groups.dp.size - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def step(self, *, lr: float) -> float:
        dp = self.groups.dp
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        shard_grad = dp.reduce_scatter(grads, dim=0, site="zero1.grads", phase="backward") if dp.size > 1 else grads
        shard_grad = shard_grad / dp.size                              # [shard_size], averaged
        sumsq = (shard_grad.double().pow(2) * self.count_mask.double()).sum()
        self.last_grad_norm = clip_grad_norm([], self.groups, max_norm=self.max_grad_norm, local_sumsq=sumsq)
        coef = self.max_grad_norm / (self.last_grad_norm + 1e-6)
        if self.max_grad_norm > 0 and coef < 1.0:
            shard_grad = shard_grad * coef
        self.shard.grad = shard_grad
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        full = dp.all_gather(self.shard.detach(), dim=0, site="zero1.params") if dp.size > 1 else self.shard.detach()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return self.last_grad_norm

    def _gather_state(self, key: str) -> torch.Tensor:
        local = self.opt.state[self.shard][key].detach()
        dp = self.groups.dp
        return dp.all_gather(local, dim=0, site="zero1.checkpoint") if dp.size > 1 else local

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """Per-parameter state, gathered over dp (collective over the dp group)."""
        if self.shard not in self.opt.state:
            return {}, 0
        full = {k: self._gather_state(k) for k in ("exp_avg", "exp_avg_sq")}
        states, offset = {}, 0
        for n, p in self.named:
            states[n] = {k: v[offset:offset + p.numel()].view_as(p).clone() for k, v in full.items()}
            offset += p.numel()
        return states, int(self.opt.state[self.shard]["step"])

    def load_state_by_name(self, states: dict, step: int) -> None:
        flat = {k: self._flat([states[n][k].to(p) for n, p in self.named]) for k in ("exp_avg", "exp_avg_sq")}
        sl = slice(self.start, self.start + self.shard_size)
        self.opt.state[self.shard] = {"step": torch.tensor(float(step)),
                                      "exp_avg": flat["exp_avg"][sl].clone(),
                                      "exp_avg_sq": flat["exp_avg_sq"][sl].clone()}


def make_optimizer(named_params, groups: ProcessGroups, *, zero1: bool, bucket_bytes: int, **kw):
    """:class:`ShardedAdamW` when ``zero1``, else :class:`ReplicatedAdamW`."""
    if zero1:
        return ShardedAdamW(named_params, groups, **kw)
    return ReplicatedAdamW(named_params, groups, bucket_bytes=bucket_bytes, **kw)
