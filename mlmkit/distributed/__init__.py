"""Process groups built from a Topology, traced collectives, and a multi-process launcher.

The names below are loaded on first use (PEP 562): ``mlmkit.distributed.rendezvous`` (what a batch
job's launcher set: world size, rank, master address) imports without torch, so
``python -m mlmkit.train`` refuses a world size that does not fit the config before it spends
seconds importing torch.
"""

import importlib

# the public names -> the submodule that defines each
_HOME = {
    "calibrate_local_cpu": "calibrate",
    "CommGroup": "comm_group",
    "keep_freed_memory": "host_memory",
    **{name: "launch" for name in ("RankFailure", "RankTimeout", "find_free_port", "preload_in_ranks", "run_ranks")},
    **{name: "process_groups" for name in ("ProcessGroups", "default_backend", "default_device", "init_distributed")},
}

__all__ = list(_HOME)


def __getattr__(name):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mlmkit.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mlmkit.distributed.{home}"), name)
    globals()[name] = value            # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
