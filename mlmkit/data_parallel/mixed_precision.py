"""Mixed precision as Megatron-LM does it (``--bf16``): bf16 parameters and compute, fp32 gradients.

Each parameter gets an fp32 ``main_grad`` buffer (Megatron-LM's contiguous gradient buffer, one per
parameter here). After every backward pass that reaches a parameter, a post-accumulate hook adds
its bf16 ``.grad`` into ``main_grad`` and frees it, so gradients accumulate across microbatches in
fp32. The optimizers (:mod:`mlmkit.data_parallel.optimizer`) reduce and clip ``main_grad`` and
update fp32 master weights; the loss and the softmax of the cross-entropy are computed in fp32
(:func:`mlmkit.tensor_parallel.vocab_parallel_cross_entropy`). bf16 keeps fp32's exponent range,
so no loss scaling is needed (fp16 would need it).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

__all__ = ["PRECISIONS", "attach_main_grads", "dtype_of"]

#: Training precisions: parameter/compute dtype of each.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def dtype_of(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def main_grad(param: torch.Tensor) -> torch.Tensor:
    """The parameter's fp32 gradient buffer, allocated (zeroed) if ZeRO-2/3 freed it."""
    if param.main_grad is None:
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    return param.main_grad


def _accumulate(param: torch.Tensor) -> None:
    # A deferred weight gradient (split backward) reaches the hook without a gradient: W adds it later.
    if param.grad is not None:
        main_grad(param).add_(param.grad)     # bf16 -> fp32, accumulated across microbatches
        param.grad = None


def attach_main_grads(params: Iterable[nn.Parameter]) -> None:
    """Give each parameter an fp32 ``main_grad`` (zeroed) that its backward passes accumulate into."""
    for p in params:
        if getattr(p, "mixed_precision", False):
            continue
        p.mixed_precision = True
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.register_post_accumulate_grad_hook(_accumulate)
