"""Megatron-LM's tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Every parameter these layers create carries attributes that the rest of mlmkit reads (shard
tables, gradient gathering in tests, checkpoint resharding, gradient clipping):

- ``tp_split_dim``: the dimension split across the TP group (``None``: replicated on every TP rank);
- ``tp_partitions``: that dimension is made of this many equal blocks, each split over the group
  (a fused SwiGLU ``[gate; up]`` weight: each rank holds matching halves of both), default 1;
- ``tp_replicas``: this many consecutive TP ranks hold the same shard (key/value heads when
  tp > kv_heads, as Megatron-LM does); their gradients are summed after backward
  (:func:`sync_replicated_grads`), default 1;
- ``global_shape``: the shape of the full, unsplit parameter;
- ``sequence_parallel``: ``True`` for replicated parameters applied to sequence shards, whose
  gradients must be summed over the TP group after backward (:func:`sync_sequence_parallel_grads`).

:func:`shard_full` and :func:`unshard` turn a full tensor into a rank's shard and back; the model,
the shard gathering and the checkpoints all use them. A parameter's gradient is :func:`param_grad`:
the fp32 ``main_grad`` under mixed precision, else ``.grad``.

Weights are initialised at full size by an ``init`` callable (deterministic from a seed), then
sliced, so a model's function does not depend on the TP degree.

Shapes: ``[s, b, h]``; ``t`` = TP degree. Reference: Shoeybi et al. 2019, section 3.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mlmkit.distributed import CommGroup
from mlmkit.tensor_parallel.weight_grad import WeightGradStore, linear
from mlmkit.tensor_parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "divide", "mark_parameter", "param_grad",
    "shard_full", "sync_replicated_grads", "sync_sequence_parallel_grads", "unshard",
]

Init = Callable[[Sequence[int]], torch.Tensor]


def divide(numerator: int, denominator: int, *, what: str) -> int:
    """``numerator // denominator``, or a ValueError naming both numbers."""
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tp={denominator}; choose {what} as a multiple "
            f"of {denominator} or a tp that divides {numerator}."
        )
    return numerator // denominator


def _default_init(shape: Sequence[int]) -> torch.Tensor:
    return torch.randn(*shape) * 0.02


def mark_parameter(param: nn.Parameter, *, split_dim: Optional[int], global_shape: Sequence[int],
                   sequence_parallel: bool = False, partitions: int = 1, replicas: int = 1) -> nn.Parameter:
    """Attach mlmkit's sharding metadata to ``param`` (see module docstring)."""
    param.tp_split_dim = split_dim
    param.tp_partitions = partitions
    param.tp_replicas = replicas
    param.global_shape = tuple(global_shape)
    param.sequence_parallel = sequence_parallel
    return param


def param_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the optimizer uses: the fp32 ``main_grad`` under mixed precision, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def shard_full(full: torch.Tensor, *, dim: Optional[int], tp_size: int, tp_rank: int, partitions: int = 1,
               replicas: int = 1) -> torch.Tensor:
    """This TP rank's shard of ``full``: along ``dim``, each of the ``partitions`` blocks is cut into
    ``tp_size / replicas`` pieces and rank ``r`` holds piece ``r // replicas`` of every block."""
    if dim is None or tp_size == 1:
        return full
    shards, idx = tp_size // replicas, tp_rank // replicas
    blocks = full.chunk(partitions, dim=dim)
    return torch.cat([b.chunk(shards, dim=dim)[idx] for b in blocks], dim=dim)


def unshard(shards: Sequence[torch.Tensor], *, dim: Optional[int], partitions: int = 1,
            replicas: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard (in TP rank order): the inverse of :func:`shard_full`."""
    if dim is None or len(shards) == 1:
        return shards[0]
    distinct = [s.chunk(partitions, dim=dim) for s in list(shards)[::replicas]]
    return torch.cat([torch.cat([d[k] for d in distinct], dim=dim) for k in range(partitions)], dim=dim)


def _shard(full: torch.Tensor, dim: int, group: CommGroup, partitions: int = 1, replicas: int = 1) -> torch.Tensor:
    return shard_full(full, dim=dim, tp_size=group.size, tp_rank=group.rank, partitions=partitions,
                      replicas=replicas).clone()


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output rows: rank i computes ``Y_i = X A_i^T + b_i``.

    forward: input ``[s, b, in]`` full on every rank (``[s/t, b, in]`` with sequence parallelism,
    all-gathered first); output ``[s, b, out/t]``, or ``[s, b, out]`` with ``gather_output``.
    backward: the input gradient is all-reduced over TP (f's backward), or reduce-scattered along
    the sequence with sequence parallelism.

    Args:
        in_features, out_features: global sizes; ``out_features`` must divide by ``tp.size``.
        tp: the tensor-parallel group. ``init``: full-size weight initialiser.
        gather_output: all-gather the output along the last dim.
        sequence_parallel: input is split along the sequence (Korthikanti et al. 2022).
        wgrad: a :class:`~mlmkit.tensor_parallel.WeightGradStore` that can defer the weight
            gradient of a split backward (zero-bubble schedules).
        partitions: the output is made of this many blocks, each split over tp (fused projections
            such as SwiGLU's ``[gate; up]``: each rank holds matching pieces of every block).
        replicas: this many consecutive TP ranks hold the same output rows (key/value heads when
            tp > kv_heads); their weight gradients must be summed (:func:`sync_replicated_grads`).
        site: name used in traces and error messages (e.g. ``"layers.0.mlp.fc1"``).
    """

    def __init__(self, in_features: int, out_features: int, *, tp: CommGroup, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init: Optional[Init] = None, site: str = "column", device=None, partitions: int = 1,
                 replicas: int = 1, wgrad: Optional[WeightGradStore] = None):
        super().__init__()
        self.wgrad = wgrad
        if tp.size % replicas:
            raise ValueError(f"ColumnParallelLinear '{site}': replicas={replicas} does not divide tp={tp.size}")
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.gather_output, self.sequence_parallel, self.site = tp, gather_output, sequence_parallel, site
        shards = tp.size // replicas
        self.out_local = divide(out_features, shards * partitions, what=f"{site}: out_features") * partitions
        full = (init or _default_init)((out_features, in_features))
        self.weight = mark_parameter(nn.Parameter(_shard(full, 0, tp, partitions, replicas).to(device)), split_dim=0,
                                     global_shape=(out_features, in_features), partitions=partitions,
                                     replicas=replicas)
        if bias:
            self.bias = mark_parameter(nn.Parameter(torch.zeros(self.out_local, device=device)),
                                       split_dim=0, global_shape=(out_features,), partitions=partitions,
                                       replicas=replicas)
        else:
            self.register_parameter("bias", None)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Enter the tensor-parallel region: f (copy; all-reduce of the gradient in backward), or
        with sequence parallelism the all-gather along the sequence. Several column-parallel
        linears reading the same input (q and kv, gate and up) enter once and share it."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear '{self.site}' expects input [..., {self.in_features}] on every "
                f"rank (the full input width; only the output is split over tp={self.tp.size}), "
                f"got {list(x.shape)}."
            )
        if self.sequence_parallel:
            return gather_from_sequence(x, self.tp, site=self.site)   # [s/t, b, in] -> [s, b, in]
        return copy_to_tp(x, self.tp, site=self.site)                 # [s, b, in], grad all-reduced

    def forward(self, x: torch.Tensor, *, entered: bool = False) -> torch.Tensor:
        """``entered``: ``x`` already is :meth:`enter`'s output (shared with another linear)."""
        if not entered:
            x = self.enter(x)
        y = linear(x, self.weight, self.bias, self.wgrad)          # [s, b, out/t]
        if self.gather_output:
            y = gather_from_tp(y, self.tp, site=self.site)         # [s, b, out]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_local}), "
                f"tp={self.tp.size}, sp={self.sequence_parallel}, site={self.site!r}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input columns: ``Y = sum_i X_i A_i^T + b``.

    forward: input ``[s, b, in/t]`` already split (the output of a column-parallel layer); partial
    products ``[s, b, out]`` are all-reduced (g), or reduce-scattered to ``[s/t, b, out]`` with
    sequence parallelism; the replicated bias is added after the reduction.
    backward: the output gradient reaches every rank unchanged (or is all-gathered along the
    sequence), so each rank computes the gradient of its own input slice; no reduction needed.
    """

    def __init__(self, in_features: int, out_features: int, *, tp: CommGroup, bias: bool = True,
                 sequence_parallel: bool = False, init: Optional[Init] = None, site: str = "row",
                 device=None, wgrad: Optional[WeightGradStore] = None):
        super().__init__()
        self.wgrad = wgrad
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.sequence_parallel, self.site = tp, sequence_parallel, site
        self.in_local = divide(in_features, tp.size, what=f"{site}: in_features")
        full = (init or _default_init)((out_features, in_features))
        self.weight = mark_parameter(nn.Parameter(_shard(full, 1, tp).to(device)), split_dim=1,
                                     global_shape=(out_features, in_features))
        if bias:
            self.bias = mark_parameter(nn.Parameter(torch.zeros(out_features, device=device)),
                                       split_dim=None, global_shape=(out_features,),
                                       sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_local:
            raise ValueError(
                f"RowParallelLinear '{self.site}' expects input [..., {self.in_local}] on each rank: its "
                f"slice of the global [..., {self.in_features}] split over tp={self.tp.size}; got "
                f"{list(x.shape)}. (Feed it the un-gathered output of a ColumnParallelLinear.)"
            )
        y = linear(x, self.weight, None, self.wgrad)                    # [s, b, out] partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp, site=self.site)  # [s/t, b, out]
        else:
            y = reduce_from_tp(y, self.tp, site=self.site)              # [s, b, out]
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_local}), out={self.out_features}, "
                f"tp={self.tp.size}, sp={self.sequence_parallel}, site={self.site!r}")


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the (padded) vocabulary split across TP ranks.

    Rank i holds rows ``[i*V/t, (i+1)*V/t)``. forward: tokens ``[b, s]`` outside this rank's range
    look up zeros; the partial embeddings ``[s, b, h]`` are summed by an all-reduce (or
    reduce-scattered to ``[s/t, b, h]`` with sequence parallelism). backward: each rank receives the
    full output gradient and accumulates it into its own rows only.

    ``num_embeddings`` is the padded vocabulary (a multiple of ``tp.size``, Megatron-LM's
    make-vocab-size-divisible-by); ``vocab_size`` the real one, for checking token ids.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: CommGroup, vocab_size: int,
                 sequence_parallel: bool = False, init: Optional[Init] = None, site: str = "embedding",
                 device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.vocab_size = num_embeddings, embedding_dim, vocab_size
        self.tp, self.sequence_parallel, self.site = tp, sequence_parallel, site
        per_rank = divide(num_embeddings, tp.size, what=f"{site}: padded vocabulary")
        self.vocab_start, self.vocab_end = tp.rank * per_rank, (tp.rank + 1) * per_rank
        full = (init or _default_init)((num_embeddings, embedding_dim))
        self.weight = mark_parameter(nn.Parameter(_shard(full, 0, tp).to(device)), split_dim=0,
                                     global_shape=(num_embeddings, embedding_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"VocabParallelEmbedding '{self.site}' expects token ids [b, s], got {list(tokens.shape)}")
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"token id {int(tokens[bad][0])} is outside the vocabulary [0, {self.vocab_size}); check the "
                f"tokenizer against GPTConfig.vocab_size."
            )
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        emb = emb.transpose(0, 1).contiguous()                                            # [s, b, h]
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(emb, self.tp, site=self.site)              # [s/t, b, h]
        return reduce_from_tp(emb, self.tp, site=self.site)                              # [s, b, h]

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} padded to {self.num_embeddings}, rows [{self.vocab_start}, "
                f"{self.vocab_end}), dim={self.embedding_dim}, tp={self.tp.size}, site={self.site!r}")


def sync_sequence_parallel_grads(module: nn.Module, tp: CommGroup) -> None:
    """Sum, over the TP group, the gradients of replicated parameters used on sequence shards.

    With sequence parallelism, LayerNorm weights, row-parallel biases and position embeddings are
    replicated but each rank applies them to its own ``s/t`` tokens, so each rank holds a partial
    gradient. Call after backward, before the optimizer (Megatron-LM does the same in its
    finalize-grads step). One all-reduce of the flattened gradients.
    """
    if tp.size == 1:
        return
    grads = [param_grad(p) for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and param_grad(p) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.all_reduce(flat, site="sequence_parallel_grads", phase="backward")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_replicated_grads(module: nn.Module, tp: CommGroup) -> None:
    """Sum the gradients of shards held by several TP ranks (``tp_replicas > 1``) over those ranks.

    Key/value heads replicated over ``r = tp / kv_heads`` ranks: each replica computed the weight
    gradient from its own query heads only, so the true gradient is the sum over the replicas
    (the input gradient needs nothing more: f's all-reduce already sums every rank's share). One
    all-reduce over TP of a buffer with one slot per distinct shard (the others are zero).
    """
    if tp.size == 1:
        return
    params = [p for p in module.parameters() if getattr(p, "tp_replicas", 1) > 1 and param_grad(p) is not None]
    if not params:
        return
    slots = [tp.size // p.tp_replicas for p in params]
    flat = torch.zeros(sum(n * p.numel() for n, p in zip(slots, params)), dtype=param_grad(params[0]).dtype,
                       device=param_grad(params[0]).device)
    offset, where = 0, []
    for n, p in zip(slots, params):
        start = offset + (tp.rank // p.tp_replicas) * p.numel()
        flat[start:start + p.numel()] = param_grad(p).reshape(-1)
        where.append(start)
        offset += n * p.numel()
    tp.all_reduce(flat, site="replicated_kv_grads", phase="backward")
    for p, start in zip(params, where):
        param_grad(p).copy_(flat[start:start + p.numel()].view_as(p))
