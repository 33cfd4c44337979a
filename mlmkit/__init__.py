"""mlmkit: Megatron-style tensor, pipeline and data parallelism, small enough to read and step through.

Public surface:

- :class:`Topology` - the tp x dp x pp rank grid (pure Python, no torch.distributed).
- :mod:`mlmkit.distributed` - process groups per rank, traced collectives, ``run_ranks``.
- :class:`GPTConfig`, :class:`GPT` - the model (serial at tp=1), :func:`shard_table`.
- :mod:`mlmkit.tensor_parallel` - Megatron's layers and communication operators.
"""

from mlmkit.topology import Coords, Topology

__version__ = "0.1.0"

__all__ = ["Coords", "GPT", "GPTConfig", "Topology", "shard_table", "__version__"]


def __getattr__(name):
    # The model pulls in torch; keep `import mlmkit` (and the planning layer) light until it is used.
    if name in ("GPT", "GPTConfig", "shard_table"):
        from mlmkit import model

        return getattr(model, name)
    raise AttributeError(f"module 'mlmkit' has no attribute {name!r}")
