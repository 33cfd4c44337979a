"""Memory per rank over time: exact byte accounting on CPU, torch.cuda statistics on GPUs.

On CPU there is no allocator to ask, so :class:`MemoryTracker` counts what training holds:

- parameters and gradients: the bytes of every local parameter and of its ``.grad``;
- optimizer state: every tensor in the optimizer's state (and ZeRO-1's fp32 shard);
- activations: every tensor autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``. Each saved tensor is counted by its *storage*,
  once however many views of it are saved, from the moment it is saved until autograd drops it;
  storages of parameters are not activations and are skipped.

That is what a GPU would have to hold for these tensors, so a laptop run shows the same picture
(without the allocator's caching and fragmentation, and without temporaries that are freed within
one operation; nor the tensors a recomputed region re-creates in backward, which live under the
checkpoint's own hooks: one layer's activations at a time, on top of the count). On CUDA the
rows also carry ``torch.cuda.memory_allocated``/``reserved`` and the peak since the previous row.

One row per schedule action (recorded by the executor): time, action, microbatch, and the bytes of
each category at the end of the action, plus the activation peak during it, and the optimizer step
(as in the tracer's rows: a step abandoned and run again keeps only the rows of the run that finished).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Iterable, Optional

import torch

from mlmkit.tensor_parallel.layers import param_grad

__all__ = ["MEMORY_COLUMNS", "MemoryTracker"]

MEMORY_COLUMNS = ("rank", "time", "action", "microbatch", "chunk", "parameters", "gradients", "optimizer",
                  "activations", "activations_peak", "cuda_allocated", "cuda_reserved", "cuda_peak", "step")


def _whole_bytes(p: torch.Tensor) -> int:
    """A parameter's bytes, or 0 for a ZeRO-3 parameter between uses (its one-element placeholder)."""
    whole = p.numel() * p.element_size()
    return whole if p.untyped_storage().nbytes() >= whole else 0


class _Saved:
    """What the pack hook hands autograd instead of the tensor: releases its bytes when dropped."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MemoryTracker:
    """Counts one rank's bytes (see module docstring). Pass it to the executor; read :meth:`frame`.

    Args:
        rank: the global rank, written into every row.
        params: the rank's parameters (all model chunks).
        optimizer: an mlmkit optimizer (its ``state_tensors()`` are counted).
    """

    def __init__(self, *, rank: int, params: Iterable[torch.nn.Parameter], optimizer=None):
        self.rank = rank
        self.params = list(params)
        self.optimizer = optimizer
        # By storage object, not address: ZeRO-3 frees and re-allocates parameter storages.
        self._param_storages = {p.untyped_storage()._cdata for p in self.params}
        self._live: dict[int, list] = {}   # storage ptr -> [refcount, nbytes]
        self.activations = 0
        self.peak = 0
        self.rows: list[tuple] = []
        self.step = 0                        # the optimizer step written into every row (the trainer sets it)
        self._mark: Optional[int] = None     # rows at the start of the step in progress (see rewind)
        self.cuda = torch.cuda.is_available()

    # -------------------------------------------------------------- saved tensors
    def _hold(self, t: torch.Tensor):
        """Count ``t``'s storage once more (its bytes the first time); the storage's address, or
        ``None`` for a parameter's storage or an empty one (not activations)."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if st._cdata in self._param_storages or ptr == 0:
            return None
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, st.nbytes()]
            self.activations += st.nbytes()
            self.peak = max(self.peak, self.activations)
        else:
            entry[0] += 1
        return ptr

    def _pack(self, t: torch.Tensor):
        ptr = self._hold(t)
        if ptr is None:
            return t
        # Detached: the same storage, without the grad_fn. A saved *output* would otherwise hold its
        # own node (node -> saved box -> tensor -> grad_fn -> node), a cycle through C++ that Python's
        # collector cannot see: a graph abandoned before its backward (a reset or failed step) would
        # keep its activations forever. Backward only reads the saved values.
        box = _Saved(t.detach())
        weakref.finalize(box, self._release, ptr)
        return box

    @staticmethod
    def _unpack(box):
        return box.tensor if isinstance(box, _Saved) else box

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.activations -= entry[1]
            del self._live[ptr]

    def retain(self, tensors) -> list[int]:
        """Count ``tensors`` (by storage, once) until :meth:`release`: what a split backward keeps for
        its weight gradients (a layer's input and output gradient) after the graph is freed."""
        token = []
        for t in tensors:
            ptr = self._hold(t)
            if ptr is not None:
                token.append(ptr)
        return token

    def release(self, token: list[int]) -> None:
        for ptr in token:
            self._release(ptr)

    @contextlib.contextmanager
    def saving(self):
        """Count tensors saved for backward inside this block (wrap each forward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # -------------------------------------------------------------- snapshots
    def parameter_bytes(self) -> int:
        """Bytes of the parameters as they are now (a ZeRO-3 parameter between uses holds none) and
        of the parameter shards ZeRO-3 keeps."""
        total = sum(_whole_bytes(p) for p in self.params)
        shards = getattr(self.optimizer, "parameter_tensors", None)
        if shards is not None:
            total += sum(t.numel() * t.element_size() for t in shards())
        return total

    def gradient_bytes(self) -> int:
        """Bytes of the gradients (the fp32 ``main_grad`` buffers under mixed precision)."""
        total = 0
        for p in self.params:
            g = param_grad(p)
            if g is not None:
                total += g.numel() * g.element_size()
        shards = getattr(self.optimizer, "gradient_tensors", None)     # ZeRO-2/3: reduced shards
        if shards is not None:
            total += sum(t.numel() * t.element_size() for t in shards())
        return total

    def optimizer_bytes(self) -> int:
        """Bytes the optimizer holds: Adam's moments, master weights (mixed precision), ZeRO-1's shard."""
        if self.optimizer is None or not hasattr(self.optimizer, "state_tensors"):
            return 0
        return sum(t.numel() * t.element_size() for t in self.optimizer.state_tensors())

    def record(self, *, action: str, microbatch: int = -1, chunk: int = 0) -> None:
        """Append a row for the action that just ended, and reset the activation peak."""
        cuda = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()) \
            if self.cuda else (0, 0, 0)
        self.rows.append((self.rank, time.perf_counter(), action, microbatch, chunk, self.parameter_bytes(),
                          self.gradient_bytes(), self.optimizer_bytes(), self.activations, self.peak, *cuda, self.step))
        self.peak = self.activations
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(MEMORY_COLUMNS))

    def clear(self) -> None:
        self.rows.clear()
        if self._mark is not None:
            self._mark = 0                   # a step in progress: its rows so far are gone too

    def mark(self) -> None:
        """Remember where the rows stand (a step begins), for :meth:`rewind`; the activation peak
        starts again from what is held now (not from an abandoned step's)."""
        self._mark = len(self.rows)
        self.peak = self.activations
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def rewind(self) -> None:
        """Drop the rows recorded since :meth:`mark` (an abandoned step, run again from its start:
        its partial rows would read as part of that step). The byte counts are not rows: what the
        abandoned step held is released when its graph is dropped."""
        if self._mark is not None:
            del self.rows[self._mark:]
            self._mark = None

    def unmark(self) -> None:
        """The step finished: its rows stay."""
        self._mark = None

    def __repr__(self) -> str:
        return (f"MemoryTracker(rank={self.rank}, parameters={self.parameter_bytes()} B, "
                f"activations now {self.activations} B, rows={len(self.rows)})")

