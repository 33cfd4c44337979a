"""Random state for tensor parallelism: which dropout masks agree across TP ranks, and which differ.

Megatron-LM (``tensor_parallel/random.py``) keeps two streams per rank:

- the **replicated** stream, identical on every rank of a TP group (seed ``seed + 100 * pp_rank``):
  used where all TP ranks hold the same tensor (dropout after the row-parallel output, on the
  residual, on embeddings), so the replicas stay identical;
- the **tensor-parallel** stream, different on each TP rank (seed ``seed + 2718 + 100 * pp_rank +
  tp_rank``): used where each rank holds a different slice (attention-probability dropout, whose
  heads are split; and every dropout of the sequence-parallel region, whose sequence is split).

Instead of Megatron's global tracker, mlmkit holds the two ``torch.Generator`` objects in a
:class:`TPRandomState` that each model chunk owns and passes to its layers. With several chunks per
pipeline rank (interleaved or V-shaped schedules) Megatron's chunks share the rank's one stream, so
their masks depend on the order the schedule runs them; mlmkit's chunks each have their own, seeded
by the virtual stage in place of ``pp_rank`` (the same seeds for a rank's first chunk), so no two
chunks repeat each other's masks, and a chunk's masks do not depend on how the schedule interleaves
the chunks (every schedule runs a chunk's forwards in microbatch order).
"""

from __future__ import annotations

import torch

__all__ = ["TPRandomState", "dropout"]

_TP_SEED_OFFSET = 2718  # Megatron-LM's offset for the model-parallel stream
_PP_SEED_STRIDE = 100   # Megatron-LM: seed + 100 * pipeline rank


class TPRandomState:
    """The two random streams of one rank (see the module docstring)."""

    def __init__(self, *, seed: int, tp_rank: int = 0, pp_rank: int = 0, device=None):
        device = torch.device(device or "cpu")
        self.seed, self.tp_rank, self.pp_rank = seed, tp_rank, pp_rank
        self.replicated = torch.Generator(device=device)
        self.replicated.manual_seed(seed + _PP_SEED_STRIDE * pp_rank)
        self.tensor_parallel = torch.Generator(device=device)
        self.tensor_parallel.manual_seed(seed + _TP_SEED_OFFSET + _PP_SEED_STRIDE * pp_rank + tp_rank)

    def get_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.replicated.get_state(), self.tensor_parallel.get_state()

    def set_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.replicated.set_state(state[0])
        self.tensor_parallel.set_state(state[1])

    def __repr__(self) -> str:
        return f"TPRandomState(seed={self.seed}, tp_rank={self.tp_rank}, pp_rank={self.pp_rank})"


def dropout(x: torch.Tensor, p: float, *, generator: torch.Generator, training: bool) -> torch.Tensor:
    """Inverted dropout drawing its mask from ``generator``.

    forward: ``x * mask / (1 - p)`` with ``mask ~ Bernoulli(1 - p)``; backward: the same mask
    scales the gradient (autograd of the product).
    """
    if not training or p == 0.0:
        return x
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    return x * keep / (1.0 - p)
