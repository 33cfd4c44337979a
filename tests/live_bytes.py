"""Every byte of tensor storage alive on this process's CPU, counted independently of mlmkit.

:class:`LiveBytes` is a ``TorchDispatchMode``: it registers the storage of every tensor an operator
returns (and of the tensors given to :meth:`LiveBytes.add`, such as parameters made before it was
entered) and forgets it when the storage is freed. What a training step holds beyond mlmkit's
:class:`~mlmkit.trace.memory.MemoryTracker` (its parameters, gradients, optimizer state and saved
activations) shows up as the difference of the two: tensors kept by the pipeline executor, and
anything that leaks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}      # storage handle -> bytes
        self._ignored: set[int] = set()
        self._ignored_alive: list[torch.Tensor] = []
        self.bytes = 0

    def ignore(self, t: torch.Tensor) -> None:
        """Never count ``t``'s storage (input data that exists before and after the step)."""
        self._ignored.add(t.untyped_storage()._cdata)
        self._ignored_alive.append(t)            # keeps the handle from being reused

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key, n = st._cdata, st.nbytes()
        if key in self._live or key in self._ignored or n == 0 or t.device.type != "cpu":
            return
        self._live[key] = n
        self.bytes += n
        weakref.finalize(st, self._drop, key)   # the storage's Python object lives as long as it does

    def _drop(self, key: int) -> None:
        self.bytes -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out
