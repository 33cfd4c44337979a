"""Data-parallel gradient averaging in buckets, and which copies count towards the global gradient norm.

After backward, every model replica (dp rank) holds gradients of its own slice of the batch. They
are averaged over the dp group with all-reduces of flat *buckets* of gradients (at most
``bucket_bytes`` each, parameters in reverse order as Megatron-LM and DDP do, so a bucket holds
neighbouring layers). Fewer, larger messages pay the per-message latency less often.

Gradient-norm clipping must count every parameter element exactly once in the whole job (the
optimizers of :mod:`mlmkit.data_parallel.optimizer` and :mod:`~mlmkit.data_parallel.zero` sum
their shares with these rules, then clip):

- a TP-split parameter: each TP rank holds a distinct slice, all counted;
- a replicated parameter (LayerNorm, row-parallel bias, position embedding): counted on TP rank 0 only;
- a shard held by several TP ranks (key/value heads when tp > kv_heads): counted on the first of them;
- the last stage's copy of a tied word embedding: not counted (the first stage's is), whether
  it sits on another pipeline rank or, as a later model chunk, on the same one (``pp = 1`` with
  ``chunks > 1``);
- data-parallel and context-parallel replicas hold identical (averaged) gradients: counted once
  (each share is divided by their number, dp x cp);
- an expert's parameters: split over expert-tp ranks (or counted on the first), held identically by
  its expert-dp replicas (divided by their number).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from mlmkit.distributed import CommGroup, ProcessGroups
from mlmkit.tensor_parallel.layers import param_grad

__all__ = ["allreduce_gradients", "bucketize", "counted_once", "counted_once_expert"]


def bucketize(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Split ``params`` (in the given order) into consecutive buckets of at most ``bucket_bytes``
    (a parameter larger than a bucket gets a bucket of its own, and so does a tied word embedding's
    copy: see :func:`allreduce_gradients`)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    params = list(params)
    counts = _bucket_sizes([p.numel() * p.element_size() for p in params], bucket_bytes,
                           alone=[bool(getattr(p, "tied_embedding", False)) for p in params])
    buckets, start = [], 0
    for n in counts:
        buckets.append(params[start:start + n])
        start += n
    return buckets


def allreduce_gradients(params: Iterable[nn.Parameter], dp: CommGroup, *, bucket_bytes: int = 25 * 2**20,
                        reduce_dtype: Optional[torch.dtype] = None, divisor: Optional[int] = None) -> int:
    """Average gradients over the dp group, one all-reduce per bucket. Returns the number of buckets.
    ``divisor``: what the sum is divided by (default the group's size; expert parameters use dp x cp).

    The gradients are :func:`~mlmkit.tensor_parallel.param_grad` (fp32 ``main_grad`` under mixed
    precision); ``reduce_dtype`` (e.g. bf16) is the dtype on the wire, default: the gradients' own.
    Buckets are sized by the bytes on the wire. A tied word embedding's copy (``tied_embedding``)
    is a bucket of its own, as Megatron-LM makes it: its two copies (first and last stage, summed
    over the embedding group before) are reduced in the same layout and stay equal to the bit.
    forward/backward: not an autograd op; call it after backward, before the optimizer step.
    """
    params = [p for p in params if p.requires_grad]
    for p in params:
        if param_grad(p) is None:
            p.grad = torch.zeros_like(p)
    divisor = dp.size if divisor is None else divisor
    if dp.size == 1:
        if divisor != 1:
            for p in params:
                param_grad(p).div_(divisor)
        return 0
    grads = [param_grad(p) for p in reversed(params)]
    wire = reduce_dtype or grads[0].dtype
    sizes = _bucket_sizes([g.numel() * torch.tensor([], dtype=wire).element_size() for g in grads], bucket_bytes,
                          alone=[bool(getattr(p, "tied_embedding", False)) for p in reversed(params)])
    start = 0
    for i, count in enumerate(sizes):
        bucket = grads[start:start + count]
        start += count
        flat = torch.cat([g.reshape(-1).to(wire) for g in bucket])
        dp.all_reduce(flat, site=f"dp_grads.bucket{i}", phase="backward")
        flat = flat.to(bucket[0].dtype).div_(divisor)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(sizes)


def _bucket_sizes(nbytes: Sequence[int], bucket_bytes: int, *, alone: Optional[Sequence[bool]] = None) -> list[int]:
    # How many consecutive tensors each bucket takes (the rule of bucketize, on byte sizes). A tensor
    # marked ``alone`` (a tied word embedding's copy) is a bucket of its own: the ring reduction adds
    # an element's replicas in an order that depends on its place in the bucket, so the first and
    # the last stage's copies, identical before, stay identical only if reduced in the same layout.
    counts, size, single = [], 0, False
    for i, n in enumerate(nbytes):
        lone = bool(alone[i]) if alone is not None else False
        if counts and (size + n > bucket_bytes or lone or single):
            counts.append(0)
            size = 0
        if not counts:
            counts.append(0)
        counts[-1] += 1
        size += n
        single = lone
    return counts


def counted_once(param: nn.Parameter, groups: ProcessGroups) -> bool:
    """Whether this rank's copy of ``param`` counts towards the global gradient norm (module docstring)."""
    if getattr(param, "shared_embedding", False):      # the head's copy; the embedding itself counts
        return False
    if getattr(param, "tp_split_dim", None) is None and groups.coords.tp != 0:
        return False
    if groups.coords.tp % getattr(param, "tp_replicas", 1):
        return False
    return True


def counted_once_expert(param: nn.Parameter, groups: ProcessGroups) -> bool:
    """An expert parameter counts on every expert-tp rank when split over them, else on the first;
    its expert-dp replicas hold identical (reduced) gradients and are counted once by dividing."""
    return getattr(param, "tp_split_dim", None) is not None or groups.expert_tp.rank == 0
