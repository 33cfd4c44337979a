"""Split backward (zero-bubble pipelines): input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split a backward pass
into B, which computes the input gradient that the previous pipeline stage waits for, and W, which
computes the weight gradients nobody waits for and so can fill the pipeline's bubbles. For a linear
layer ``Y = X A^T + b``:

- B: ``dX = dY A`` (a GEMM on the critical path);
- W: ``dA = dY^T X`` and ``db = sum(dY)`` (the other GEMM, deferrable).

So B + W together cost one ordinary backward. ``torch.autograd.backward(..., inputs=params)`` is no
such split: it walks the whole graph again. Here the layers themselves keep what W needs (their
input ``X`` and output gradient ``dY``) in a :class:`WeightGradStore` while it is *deferring*, and
W runs the queued GEMMs. Parameters without a GEMM (normalisation weights, the embedding) still
get their gradient in B: cheap, and nothing to gain from deferring.

The store belongs to a model chunk and is passed to its layers explicitly (no global state). A
memory tracker attached to it counts the held tensors, so memory pictures show what W keeps alive.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["WeightGradStore", "accumulate_grad", "linear"]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into the parameter's gradient as autograd would (into the fp32 ``main_grad``
    under mixed precision)."""
    if getattr(param, "mixed_precision", False):
        if param.main_grad is None:          # freed by ZeRO-2/3 after the last reduction
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        param.main_grad.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class WeightGradStore:
    """The weight-gradient work of one model chunk, queued during a deferring backward (B) and run
    by :meth:`run` (W). ``memory``: a :class:`~mlmkit.trace.memory.MemoryTracker` that counts the
    held inputs and output gradients."""

    def __init__(self, *, memory=None):
        self.deferring = False
        self.memory = memory
        self._queue: list[tuple] = []

    @contextlib.contextmanager
    def defer(self):
        """Inside this block, linear layers queue their weight gradients instead of computing them."""
        self.deferring, was = True, self.deferring
        try:
            yield self
        finally:
            self.deferring = was

    def put(self, weight, bias, x: torch.Tensor, dy: torch.Tensor) -> None:
        token = self.memory.retain((x, dy)) if self.memory is not None else None
        self._queue.append((weight, bias, x, dy, token))

    def take(self) -> list[tuple]:
        """The queued work (then empty): hand it to the W action of the same microbatch."""
        work, self._queue = self._queue, []
        return work

    @torch.no_grad()
    def run(self, work: list[tuple]) -> None:
        """W: ``dA = dY^T X`` and ``db = sum(dY)`` for each queued layer, accumulated.

        Runs outside autograd's backward, so grad mode is off explicitly: ``X`` is an activation
        that requires grad, and with grad mode on every GEMM here would record a graph and the
        gradient would keep it (and the activations under it) alive until it is cleared.

        Last queued first: B walked the layers from the output back, so the latest ``dY`` and ``X``
        are the ones still in the CPU's cache (a microbatch's work holds each linear layer once, so
        the order changes no sum). Measured on one stage of the pipeline benchmark, W first-in-first-out
        cost 1-2.5% more CPU per step."""
        for weight, bias, x, dy2, token in reversed(work):            # dy2: [tokens, out]
            x2 = x.reshape(-1, x.shape[-1])                          # [tokens, in]
            if weight.grad is not None and not getattr(weight, "mixed_precision", False):
                weight.grad.addmm_(dy2.t(), x2)                      # dA += dY^T X, in place
            else:
                accumulate_grad(weight, torch.mm(dy2.t(), x2))       # [out, in]
            if bias is not None:
                accumulate_grad(bias, dy2.sum(0))
            if token is not None:
                self.memory.release(token)

    def drop(self, work: Optional[list[tuple]] = None) -> None:
        """Forget queued work (an abandoned step)."""
        for *_, token in (work if work is not None else self.take()):
            if token is not None and self.memory is not None:
                self.memory.release(token)

    def __repr__(self) -> str:
        return f"WeightGradStore(deferring={self.deferring}, queued={len(self._queue)})"


class _Linear(torch.autograd.Function):
    """``Y = X A^T + b`` whose backward can defer ``dA`` and ``db`` to a :class:`WeightGradStore`.

    forward: the GEMM. backward: ``dX = dY A``; then ``dA = dY^T X``, ``db = sum(dY)`` now, or
    queued when the store is deferring (the weight then gets no gradient from autograd)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # The parameters are kept by reference, not through save_for_backward: under saved-tensor
        # hooks (memory accounting) autograd hands back an alias, and a gradient that W writes onto
        # an alias would never reach the parameter.
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dy2 = dy.reshape(-1, dy.shape[-1])                            # [tokens, out]
        dx = torch.mm(dy2, weight).view(*dy.shape[:-1], weight.shape[1])   # [..., in]
        if ctx.store.deferring:
            ctx.store.put(weight, ctx.bias, x, dy2)
            return dx, None, None, None
        dw = torch.mm(dy2.t(), x.reshape(-1, x.shape[-1]))
        db = dy2.sum(0) if ctx.bias is not None else None
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """``F.linear``, with a weight gradient that ``store`` can defer (see :class:`_Linear`)."""
    if store is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, store)
