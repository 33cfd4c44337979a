"""mlmkit: Megatron-style tensor, pipeline and data parallelism, small enough to read and step through.

Public surface (see each module for details):

- :class:`Topology` - the tp x dp x pp rank grid (pure Python, no torch.distributed).
- :mod:`mlmkit.distributed` - process groups per rank, traced collectives, ``run_ranks``.
"""

from mlmkit.topology import Coords, Topology

__version__ = "0.1.0"

__all__ = ["Coords", "Topology", "__version__"]
