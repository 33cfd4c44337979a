"""Tensor-parallel communication operators (the "f" and "g" of Megatron-LM), as autograd functions.

Three thin layers, as in Megatron-Core's ``mappings.py``: the collective itself lives in
:class:`~mlmkit.distributed.CommGroup` (which traces it), a private ``torch.autograd.Function``
pairs a forward with its backward, and a public function takes the group explicitly.

Shapes: hidden states are ``[s, b, h]`` (sequence first, as in Megatron-LM), so the sequence
dimension used by sequence parallelism is dim 0 and the hidden dimension split by tensor
parallelism is the last one. ``t`` is the tensor-parallel degree.

References:
    Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
    Parallelism", section 3 and figure 3 (the f and g operators).
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4.2.2 (sequence parallelism: g and g-bar become all-gather and reduce-scatter).
"""

from __future__ import annotations

import torch

from mlmkit.distributed import CommGroup

__all__ = [
    "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
    "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
]


def _split_last(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    # [..., n] -> [..., n/t]: keep this rank's contiguous slice.
    n = x.shape[-1]
    if n % group.size:
        raise ValueError(f"cannot split last dimension {n} of {tuple(x.shape)} over tp={group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _split_first(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    # [s, ...] -> [s/t, ...]
    n = x.shape[0]
    if n % group.size:
        raise ValueError(
            f"sequence parallelism: sequence length {n} of {tuple(x.shape)} is not divisible by "
            f"tp={group.size}; choose seq_len as a multiple of tp"
        )
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous(), site=ctx.site, phase="backward"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        # In place, as Megatron-LM does: x is a fresh matmul output nobody else holds.
        ctx.mark_dirty(x)
        return group.all_reduce(x, site=site, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=-1, site=ctx.site, phase="backward"), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group = group
        return group.all_gather(x, dim=-1, site=site, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=0, site=ctx.site, phase="backward"), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return group.all_gather(x, dim=0, site=site, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad, dim=0, site=ctx.site, phase="backward"), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return group.reduce_scatter(x, dim=0, site=site, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=0, site=ctx.site, phase="backward"), None, None


def copy_to_tp(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """Megatron's **f**: enter the tensor-parallel region.

    forward: identity (every rank already holds the full input ``[s, b, h]``).
    backward: all-reduce (sum) of the input gradient over the TP group, since each rank's partial
    matmul contributed only part of it.
    """
    if group.size == 1:
        return x
    return _CopyToTP.apply(x, group, site)


def reduce_from_tp(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """Megatron's **g**: leave the tensor-parallel region.

    forward: all-reduce (sum) of the partial outputs ``[s, b, h]`` of a row-parallel matmul.
    backward: identity (the gradient of a sum reaches every summand unchanged).
    """
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group, site)


def scatter_to_tp(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """forward: keep this rank's slice of the last dim ``[..., n] -> [..., n/t]``; backward: all-gather."""
    if group.size == 1:
        return x
    return _ScatterToTP.apply(x, group, site)


def gather_from_tp(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """forward: all-gather along the last dim ``[..., n/t] -> [..., n]``; backward: keep own slice."""
    if group.size == 1:
        return x
    return _GatherFromTP.apply(x, group, site)


def scatter_to_sequence(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """Enter the sequence-parallel region. forward: keep own ``[s/t, b, h]`` slice; backward: all-gather."""
    if group.size == 1:
        return x
    return _ScatterToSequence.apply(x, group, site)


def gather_from_sequence(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """Sequence parallelism's **g** (Korthikanti et al. 2022).

    forward: all-gather along the sequence, ``[s/t, b, h] -> [s, b, h]``, before a column-parallel
    matmul. backward: reduce-scatter of the gradient ``[s, b, h] -> [s/t, b, h]`` (each rank's
    column slice contributed a partial input gradient for the whole sequence).
    """
    if group.size == 1:
        return x
    return _GatherFromSequence.apply(x, group, site)


def reduce_scatter_to_sequence(x: torch.Tensor, group: CommGroup, *, site: str = "") -> torch.Tensor:
    """Sequence parallelism's **g-bar**.

    forward: reduce-scatter of the partial outputs of a row-parallel matmul, ``[s, b, h] ->
    [s/t, b, h]`` (summed, then split along the sequence). backward: all-gather of the gradient.
    """
    if group.size == 1:
        return x
    return _ReduceScatterToSequence.apply(x, group, site)
