"""AdamW for parallel training: replicated (plain data parallelism) or sharded over dp (ZeRO-1),
in fp32 or in mixed precision. ZeRO-2 and ZeRO-3 (gradients and parameters sharded too, layer by
layer) are in :mod:`mlmkit.data_parallel.zero`; :func:`make_optimizer` picks by stage.

Both optimizers do, in :meth:`step`: average gradients over the dp group, clip to a global norm
counted once per element (:mod:`mlmkit.data_parallel.grads`), then an AdamW update
(Loshchilov & Hutter 2019). Weight decay, as Megatron-LM's default, applies to the matrices and
embeddings and not to biases and one-dimensional weights (the norms' gains): :func:`decayed`.
The optimizers apply it themselves, ``w <- w (1 - lr wd)`` on the decayed elements before torch's
AdamW (run with ``weight_decay=0``) makes its update: the same operation AdamW does first, so the
numbers are AdamW's, and a flat ZeRO shard, which holds parameters of both kinds, decays only its
stretches of decayed parameters.

- :class:`ReplicatedAdamW`: every dp rank all-reduces gradients (in buckets) and keeps the full
  optimizer state.
- :class:`ShardedAdamW` (ZeRO stage 1, Rajbhandari et al. 2020; Megatron-LM's distributed
  optimizer): parameters are viewed as one flat vector split in ``dp`` equal contiguous shards.
  Gradients are reduce-scattered (each rank receives the average of its shard only), each rank
  updates its shard with its own slice of the optimizer state, then the updated shards are
  all-gathered into every replica's parameters. Optimizer state per rank shrinks by ``dp``.

Mixed precision (Megatron-LM's ``--bf16``; :mod:`mlmkit.data_parallel.mixed_precision`): the
parameters are bf16, their gradients accumulate in fp32 ``main_grad`` buffers, and the optimizer
keeps an fp32 *master* copy of every weight (ZeRO-1: its shard is that copy), updates it with fp32
Adam moments, and casts it back into the bf16 parameters. Gradients are reduced in fp32 (or in
``grad_reduce_dtype``); ZeRO-1 gathers the updated parameters in their own dtype. Bytes per
parameter: fp32 16 (4 + 4 + 8; the parameter is the master), bf16 18 (2 + 4 + 4 + 8), and with
ZeRO-1 over ``d`` replicas 4 + 4 + 12/d and 6 + 12/d (Megatron-LM's figures).

With context parallelism the dense parameters are replicated over dp x cp ranks, so "the dp group"
above is the dp-cp group (:attr:`ProcessGroups.dp_cp`, Megatron-LM's data-parallel group with
context parallelism): gradients are averaged and ZeRO-1 shards cut over ``dp * cp`` ranks.

Mixture of experts: expert parameters are held by their own data-parallel replicas (the
expert-dp group) and have their own optimizer part: their gradients are summed over expert-dp and
divided by ``dp * cp`` (each copy of an expert summed tokens of several replicas), ZeRO-1 shards cut
over expert-dp. :func:`make_optimizer` then returns a :class:`MultiOptimizer` whose parts clip to
one global norm.

AdamW is element-wise, so updating shards gives exactly the same numbers as updating the whole.
Both expose the state per parameter name (:meth:`state_by_name`, with the master weights under
mixed precision) so checkpoints are layout-free and resume exactly.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from mlmkit.data_parallel.grads import allreduce_gradients, counted_once, counted_once_expert
from mlmkit.distributed import CommGroup, ProcessGroups
from mlmkit.tensor_parallel.layers import param_grad

__all__ = ["MultiOptimizer", "ReplicatedAdamW", "ShardedAdamW", "decayed", "make_optimizer"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def decayed(name: str, param) -> bool:
    """Whether weight decay applies to this parameter: Megatron-LM's default rule (its optimizer's
    parameter groups), none for biases and one-dimensional weights (norm gains), decay for the rest
    (linear weights, the router, word and position embeddings)."""
    return not (name == "bias" or name.endswith(".bias") or len(param.shape) == 1)


class _Base:
    """One optimizer part: the parameters reduced over one group.

    A step is :meth:`reduce_grads` (average over the replicas), :meth:`local_sumsq` (this rank's
    share of the squared global norm, each element counted once in the job), and :meth:`apply`
    (clip by ``coef``, AdamW). :meth:`step` runs all three for a part that is the whole optimizer.

    Args:
        reduce: the replicas that hold these parameters (default: the dp-cp group).
        divisor: what the summed gradients are divided by (default: ``reduce.size``).
        counted: whether a parameter's elements on this rank count towards the global norm.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], groups: ProcessGroups, *,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                 grad_reduce_dtype: Optional[torch.dtype] = None, reduce: Optional[CommGroup] = None,
                 divisor: Optional[int] = None, counted: Optional[Callable] = None, label: str = "dp"):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        names = [n for n, _ in self.named]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter names must be unique on a rank, got duplicates in {names}")
        self.params = [p for _, p in self.named]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.param_dtype = dtypes.pop() if dtypes else torch.float32
        self.mixed = self.param_dtype != torch.float32
        self.groups = groups
        self.reduce = reduce if reduce is not None else groups.dp_cp
        self.divisor = self.reduce.size if divisor is None else divisor
        self.counted = counted or (lambda p: counted_once(p, groups))
        self.label = label
        # torch's AdamW runs without decay: each optimizer applies it to the decayed elements itself
        self.hyper = dict(betas=tuple(betas), eps=eps, weight_decay=0.0)
        self.weight_decay = weight_decay
        self.decayed_ids = {id(p) for n, p in self.named if decayed(n, p)}
        self.max_grad_norm = max_grad_norm
        self.grad_reduce_dtype = grad_reduce_dtype
        self.last_grad_norm: float = float("nan")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            main = getattr(p, "main_grad", None)
            if main is not None:
                main.zero_()

    def params_loaded(self) -> None:
        """Call after the model's weights were overwritten (a checkpoint load): an optimizer that
        keeps its own copy of the weights refreshes it from the parameters."""

    def params_written(self) -> None:
        """Call after code wrote into the parameters (``Trainer.full_parameters`` does): an
        optimizer that keeps its own copy of the weights (fp32 masters, ZeRO shards) takes the
        elements that differ from it, and keeps its extra precision everywhere else (a read-only
        block changes nothing). Without it the next update would write the old weights back."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer holds (moments, master weights): what memory accounting counts."""
        return [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]

    def step(self, *, lr: float) -> float:
        """Average, clip, update. Returns the global gradient norm before clipping."""
        self.reduce_grads()
        norm = global_norm([self.local_sumsq()], self.groups)
        self.apply(lr=lr, coef=clip_coef(norm, self.max_grad_norm))
        self.last_grad_norm = norm
        return norm


def counted_spans(params, counted, start: int, size: int) -> list[tuple[int, int]]:
    """``[(a, b), ...]``: the stretches ``[a, b)`` of the shard ``[start, start + size)`` of the
    flattened ``params`` that hold parameters for which ``counted(p)`` holds (those counted towards
    the global gradient norm, or those weight decay applies to; padding never). Spans, not a mask:
    no memory the size of the shard."""
    spans, offset = [], 0
    for p in params:
        a, b = max(offset, start), min(offset + p.numel(), start + size)
        if a < b and counted(p):
            if spans and spans[-1][1] == a - start:
                spans[-1] = (spans[-1][0], b - start)
            else:
                spans.append((a - start, b - start))
        offset += p.numel()
    return spans


def decay_factor(lr: float, weight_decay: float) -> Optional[float]:
    """AdamW's decoupled decay of one step, ``1 - lr * weight_decay`` (None: nothing to do)."""
    return 1 - lr * weight_decay if weight_decay != 0 and lr != 0 else None


def apply_decay(flat: torch.Tensor, spans: list[tuple[int, int]], lr: float, weight_decay: float) -> None:
    """Decay the stretches ``spans`` of a flat fp32 shard in place (see :func:`decay_factor`)."""
    factor = decay_factor(lr, weight_decay)
    if factor is not None and spans:
        with torch.no_grad():
            torch._foreach_mul_([flat[a:b] for a, b in spans], factor)


def flatten_padded(tensors, size: int) -> torch.Tensor:
    """``tensors`` flattened into one vector ``[size]``, zero-padded at the end (the shards of a
    flat vector split over replicas)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pad = size - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def copy_flat_into(params, flat: torch.Tensor) -> None:
    """The inverse of :func:`flatten_padded` for parameters: copy consecutive pieces of ``flat``
    into ``params`` (the padding is ignored)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def shard_sumsq(grad: torch.Tensor, spans) -> torch.Tensor:
    """Sum of squares (fp64) of ``grad`` over ``spans``."""
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for a, b in spans:
        total += grad[a:b].double().pow(2).sum()
    return total


def take_written(master: torch.Tensor, written: torch.Tensor, dtype: torch.dtype) -> bool:
    """``master`` (fp32, the optimizer's copy) takes ``written`` (fp32, the parameters' values
    now) wherever the two differ once ``master`` is rounded to the parameters' ``dtype``: the
    elements code wrote. Elsewhere ``master`` keeps its bits (bf16 parameters round them away).
    Returns whether anything was written."""
    with torch.no_grad():
        changed = written != master.to(dtype).float()
        if not bool(changed.any()):
            return False
        master[changed] = written[changed]
        return True


def global_norm(sumsqs: Sequence[torch.Tensor], groups: ProcessGroups) -> float:
    """The job's gradient norm from each part's local share (one all-reduce over the world)."""
    total = torch.stack([s.double().reshape(()) for s in sumsqs]).sum() if sumsqs else \
        torch.zeros((), dtype=torch.float64, device=groups.device)
    total = total.to(groups.device).clone()
    groups.world.all_reduce(total, site="grad_norm")
    return math.sqrt(float(total))


def clip_coef(norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s rule: scale by ``max_norm / (norm + 1e-6)`` when below 1;
    ``max_norm = 0``: no clipping."""
    coef = max_norm / (norm + 1e-6)
    return coef if max_norm > 0 and coef < 1.0 else 1.0


class ReplicatedAdamW(_Base):
    """Plain data parallelism: bucketed all-reduce of gradients, full AdamW state on every rank."""

    def __init__(self, named_params, groups: ProcessGroups, *, bucket_bytes: int = 25 * 2**20, **kw):
        super().__init__(named_params, groups, **kw)
        self.bucket_bytes = bucket_bytes
        # Mixed precision: fp32 master weights; fp32: the parameters are their own master.
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else None
        self.opt = torch.optim.AdamW(self.master if self.mixed else self.params, lr=0.0, **self.hyper)
        self.decay_targets = [t for t, p in zip(self.master if self.mixed else self.params, self.params)
                              if id(p) in self.decayed_ids]

    def reduce_grads(self) -> None:
        allreduce_gradients(self.params, self.reduce, bucket_bytes=self.bucket_bytes,
                            reduce_dtype=self.grad_reduce_dtype, divisor=self.divisor)

    def local_sumsq(self) -> torch.Tensor:
        # replicas hold identical averaged gradients: each counts 1/replicas of its elements
        grads = [param_grad(p).detach() for p in self.params if param_grad(p) is not None and self.counted(p)]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.groups.device)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() / self.reduce.size

    def apply(self, *, lr: float, coef: float) -> None:
        if coef < 1.0:
            grads = [param_grad(p) for p in self.params if param_grad(p) is not None]
            if grads:
                torch._foreach_mul_(grads, coef)
        for g in self.opt.param_groups:
            g["lr"] = lr
        factor = decay_factor(lr, self.weight_decay)
        if factor is not None and self.decay_targets:
            with torch.no_grad():
                torch._foreach_mul_(self.decay_targets, factor)
        if self.mixed:
            for m, p in zip(self.master, self.params):
                m.grad = param_grad(p)
            self.opt.step()
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
                    m.grad = None
        else:
            self.opt.step()

    def params_loaded(self) -> None:
        if self.mixed:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    m.copy_(p.float())

    def params_written(self) -> None:
        if self.mixed:
            for m, p in zip(self.master, self.params):
                take_written(m, p.detach().float(), p.dtype)

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + (list(self.master) if self.mixed else [])

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        states, step = {}, 0
        for i, (n, p) in enumerate(self.named):
            st = self.opt.state.get(self.master[i] if self.mixed else p)
            if st:
                states[n] = {k: st[k].detach().clone() for k in _STATE_KEYS}
                step = int(st["step"])
            if self.mixed:
                states.setdefault(n, {})["master"] = self.master[i].detach().clone()
        return states, step

    def load_state_by_name(self, states: dict, step: int) -> None:
        for i, (n, p) in enumerate(self.named):
            st = states.get(n, {})
            target = self.master[i] if self.mixed else p
            if self.mixed and "master" in st:
                with torch.no_grad():
                    self.master[i].copy_(st["master"])
            if all(k in st for k in _STATE_KEYS):
                self.opt.state[target] = {"step": torch.tensor(float(step)),
                                          **{k: st[k].to(target).clone() for k in _STATE_KEYS}}


class ShardedAdamW(_Base):
    """ZeRO-1: optimizer state and update split across the dp group (see module docstring)."""

    def __init__(self, named_params, groups: ProcessGroups, **kw):
        super().__init__(named_params, groups, **kw)
        dp = self.reduce.size
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = -(-self.numel // dp)           # ceil(N / dp); the flat vector is zero-padded
        self.start = self.reduce.rank * self.shard_size
        flat = self._flat([p.detach().float() for p in self.params])
        self.shard = nn.Parameter(flat[self.start:self.start + self.shard_size].clone())   # fp32 master shard
        # the stretches of the shard whose elements count towards the global gradient norm
        self.counted_spans = counted_spans(self.params, self.counted, self.start, self.shard_size)
        # ... and those that weight decay applies to
        self.decay_spans = counted_spans(self.params, lambda p: id(p) in self.decayed_ids, self.start, self.shard_size)
        self.opt = torch.optim.AdamW([self.shard], lr=0.0, **self.hyper)

    def _own_slice(self) -> torch.Tensor:
        """This rank's slice of the flat parameters, fp32 ``[shard_size]``."""
        return self._flat([p.detach().float() for p in self.params])[self.start:self.start + self.shard_size]

    def params_loaded(self) -> None:
        """Refresh the fp32 shard from the model's parameters (after a checkpoint load): the update
        writes the shard back over the parameters, so a stale shard would undo the load."""
        with torch.no_grad():
            self.shard.copy_(self._own_slice())

    def params_written(self) -> None:
        take_written(self.shard, self._own_slice(), self.param_dtype)

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + [self.shard]

    def _flat(self, tensors) -> torch.Tensor:
        return flatten_padded(tensors, self.shard_size * self.reduce.size)     # [N] -> [dp * shard_size]

    def reduce_grads(self) -> None:
        dp = self.reduce
        grads = self._flat([param_grad(p) if param_grad(p) is not None else torch.zeros_like(p, dtype=torch.float32)
                            for p in self.params])
        if dp.size > 1:
            wire = grads.to(self.grad_reduce_dtype) if self.grad_reduce_dtype is not None else grads
            shard_grad = dp.reduce_scatter(wire, dim=0, site=f"zero1.grads.{self.label}", phase="backward").float()
        else:
            shard_grad = grads.float()
        self._shard_grad = shard_grad / self.divisor                  # [shard_size], averaged

    def local_sumsq(self) -> torch.Tensor:
        return shard_sumsq(self._shard_grad, self.counted_spans)

    def apply(self, *, lr: float, coef: float) -> None:
        dp = self.reduce
        self.shard.grad = self._shard_grad * coef if coef < 1.0 else self._shard_grad
        self._shard_grad = None
        for g in self.opt.param_groups:
            g["lr"] = lr
        apply_decay(self.shard, self.decay_spans, lr, self.weight_decay)
        self.opt.step()
        self.shard.grad = None
        # The updated weights travel in the parameters' own dtype (bf16 under mixed precision).
        mine = self.shard.detach().to(self.param_dtype)
        full = dp.all_gather(mine, dim=0, site=f"zero1.params.{self.label}") if dp.size > 1 else mine
        copy_flat_into(self.params, full)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        dp = self.reduce
        return dp.all_gather(local.detach(), dim=0, site="zero1.checkpoint") if dp.size > 1 else local.detach()

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """Per-parameter state, gathered over dp (collective over the dp group)."""
        full = {}
        if self.shard in self.opt.state:
            full = {k: self._gather(self.opt.state[self.shard][k]) for k in _STATE_KEYS}
        if self.mixed:
            full["master"] = self._gather(self.shard)
        states, offset = {}, 0
        for n, p in self.named:
            if full:
                states[n] = {k: v[offset:offset + p.numel()].view(p.shape).clone() for k, v in full.items()}
            offset += p.numel()
        step = int(self.opt.state[self.shard]["step"]) if self.shard in self.opt.state else 0
        return states, step

    def load_state_by_name(self, states: dict, step: int) -> None:
        sl = slice(self.start, self.start + self.shard_size)
        if all("master" in states.get(n, {}) for n, _ in self.named):
            flat = self._flat([states[n]["master"].float() for n, _ in self.named])
            with torch.no_grad():
                self.shard.copy_(flat[sl])
        if all(all(k in states.get(n, {}) for k in _STATE_KEYS) for n, _ in self.named):
            flat = {k: self._flat([states[n][k].float() for n, _ in self.named]) for k in _STATE_KEYS}
            self.opt.state[self.shard] = {"step": torch.tensor(float(step)),
                                          **{k: flat[k][sl].clone() for k in _STATE_KEYS}}


class MultiOptimizer:
    """Several optimizer parts (dense parameters over dp-cp, expert parameters over expert-dp)
    stepping together: each reduces its gradients, one global norm clips them all, each updates."""

    def __init__(self, parts: Sequence[_Base], groups: ProcessGroups, *, max_grad_norm: float):
        self.parts, self.groups, self.max_grad_norm = list(parts), groups, max_grad_norm
        self.params = [p for part in self.parts for p in part.params]
        self.last_grad_norm: float = float("nan")

    def step(self, *, lr: float) -> float:
        for part in self.parts:
            part.reduce_grads()
        norm = global_norm([part.local_sumsq() for part in self.parts], self.groups)
        coef = clip_coef(norm, self.max_grad_norm)
        for part in self.parts:
            part.apply(lr=lr, coef=coef)
        self.last_grad_norm = norm
        return norm

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def params_loaded(self) -> None:
        for part in self.parts:
            part.params_loaded()

    def params_written(self) -> None:
        for part in self.parts:
            part.params_written()

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.state_tensors()]

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        states, step = {}, 0
        for part in self.parts:
            s, n = part.state_by_name()
            states.update(s)
            step = max(step, n)
        return states, step

    def load_state_by_name(self, states: dict, step: int) -> None:
        for part in self.parts:
            part.load_state_by_name(states, step)


def make_optimizer(named_params, groups: ProcessGroups, *, zero1: bool = False, bucket_bytes: int = 25 * 2**20,
                   zero: Optional[int] = None, units=None, **kw):
    """By ZeRO stage (``zero``; ``zero1=True`` is stage 1): 0 :class:`ReplicatedAdamW`, 1
    :class:`ShardedAdamW`, 2 and 3 :class:`~mlmkit.data_parallel.zero.FullyShardedAdamW` over
    ``units`` (:func:`~mlmkit.data_parallel.zero.shard_units`, dense models only). With expert
    parameters (``param.expert``), a :class:`MultiOptimizer` of a dense part and an expert part."""
    stage = (1 if zero1 else 0) if zero is None else zero
    named_params = list(named_params)
    if stage >= 2:
        from mlmkit.data_parallel.zero import FullyShardedAdamW

        if any(getattr(p, "expert", False) for _, p in named_params):
            raise ValueError(f"zero={stage} shards dense models only: use zero=1 with experts")
        if units is None:
            raise ValueError(f"zero={stage}: give the units (mlmkit.data_parallel.zero.shard_units(chunks))")
        return FullyShardedAdamW(units, groups, stage=stage, **kw)
    zero1 = stage == 1
    dense = [(n, p) for n, p in named_params if not getattr(p, "expert", False)]
    expert = [(n, p) for n, p in named_params if getattr(p, "expert", False)]
    tied = []
    if zero1 and groups.topology.dp * groups.topology.cp > 1:
        # Each copy of a tied word embedding is a part of its own, sharded alike on the first and the
        # last stage: inside the stage's flat vector its elements would be reduce-scattered at other
        # offsets than the other copy's, summed in another order, and the copies would part by
        # rounding (the all-reduce's buckets follow the same rule: mlmkit.data_parallel.grads).
        tied = [(n, p) for n, p in dense if getattr(p, "tied_embedding", False)]
        dense = [(n, p) for n, p in dense if not getattr(p, "tied_embedding", False)]

    def part(named, **extra):
        if zero1:
            return ShardedAdamW(named, groups, **kw, **extra)
        return ReplicatedAdamW(named, groups, bucket_bytes=bucket_bytes, **kw, **extra)

    if not expert and not tied:
        return part(dense)
    dp_cp = groups.topology.dp * groups.topology.cp
    parts = [part(dense, label="dp")] if dense else []
    parts += [part([copy], label=f"embedding{i}") for i, copy in enumerate(tied)]
    if expert:
        parts.append(part(expert, reduce=groups.expert_dp, divisor=dp_cp, label="expert",
                          counted=lambda p: counted_once_expert(p, groups)))
    return MultiOptimizer(parts, groups, max_grad_norm=kw.get("max_grad_norm", 1.0))
