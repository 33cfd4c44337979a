"""Context parallelism: each sequence split over a group of ranks, attention as ring attention.

- :mod:`mlmkit.context_parallel.split` (pure planning, no torch): which tokens each cp rank holds
  (the load-balanced split of Megatron-LM / TransformerEngine, or the naive one) and which
  (query, key) blocks it computes at each ring step;
- :mod:`mlmkit.context_parallel.ring`: the ring itself (keys and values passed around
  the cp group with overlapped sends and receives, online-softmax merge, the ring backward).

The topology's ``cp`` axis (:class:`mlmkit.Topology`), ``TrainConfig.cp`` and ``--cp`` switch it on;
the model picks its tokens and positions, and gradients are averaged over the dp x cp ranks.
"""

from mlmkit.context_parallel.split import (
    SPLITS,
    Segment,
    attention_work,
    check_split,
    chunk_count,
    held_chunks,
    held_positions,
    ring_steps,
    simulate_ring,
)

__all__ = ["SPLITS", "Ring", "Segment", "attention_work", "check_split", "chunk_count", "held_chunks",
           "held_positions", "ring_attention", "ring_steps", "simulate_ring"]


def __getattr__(name):
    # The ring needs torch; the planning functions above do not (figures import them torch-free).
    if name in ("Ring", "ring_attention"):
        import mlmkit.context_parallel.ring as module

        return getattr(module, name)
    raise AttributeError(name)
