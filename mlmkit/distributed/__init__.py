"""Process groups built from a Topology, traced collectives, and a multi-process launcher."""

from mlmkit.distributed.calibrate import calibrate_local_cpu
from mlmkit.distributed.comm_group import CommGroup
from mlmkit.distributed.host_memory import keep_freed_memory
from mlmkit.distributed.launch import RankFailure, RankTimeout, find_free_port, preload_in_ranks, run_ranks
from mlmkit.distributed.process_groups import (
    ProcessGroups,
    default_backend,
    default_device,
    init_distributed,
)

__all__ = [
    "CommGroup", "ProcessGroups", "calibrate_local_cpu", "RankFailure", "RankTimeout", "default_backend", "default_device",
    "find_free_port", "init_distributed", "keep_freed_memory", "preload_in_ranks", "run_ranks",
]
