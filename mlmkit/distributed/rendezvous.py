"""Where a multi-process job meets: an address every rank can reach and a free port, and the
ranks' view of a job that Slurm (``srun``) or torchrun started.

``python -m mlmkit.distributed.rendezvous --nodes N`` prints ``ADDRESS PORT`` for a batch script to
export as ``MASTER_ADDR``/``MASTER_PORT``: on one node the loopback address (nothing is opened to
the network); on several nodes this host's first non-loopback address (a hostname that resolves to
127.0.1.1, as Debian writes into /etc/hosts, would strand the other nodes' ranks), and a port that
is free on it now, so that two jobs on one node do not collide.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["JobEnv", "job_env", "routable_address"]


def routable_address() -> str:
    """This host's first IPv4 address that is not loopback (the one its default route uses when
    there is one). Raises ``RuntimeError`` when the host has none."""
    try:       # the interface of the default route; connect() on UDP sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))                    # TEST-NET-1, never routed anywhere
            addr = s.getsockname()[0]
            if not addr.startswith("127.") and addr != "0.0.0.0":
                return addr
    except OSError:
        pass
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise RuntimeError("this host has no non-loopback IPv4 address: ranks on other nodes could not reach it; "
                       "run on one node, or set MASTER_ADDR to an address they can reach")


@dataclass(frozen=True)
class JobEnv:
    """A rank's place in a job, read from its launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    launcher: str          # "torchrun", "slurm" or "none"
    cpus_per_task: Optional[int] = None


def _tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, one entry per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out = []
    for part in text.split(","):
        count, _, times = part.partition("(x")
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def job_env(env: Mapping[str, str] = os.environ) -> JobEnv:
    """torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...) when set, else Slurm's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``...: a process started by ``srun``, with
    ``MASTER_ADDR``/``MASTER_PORT`` exported by the batch script), else one process alone."""
    port = env.get("MASTER_PORT")
    master = (env.get("MASTER_ADDR"), int(port) if port else None)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return JobEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])),
                      int(env.get("LOCAL_WORLD_SIZE", world)), *master, launcher="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env.get("SLURM_STEP_ID") is not None:
        world = int(env["SLURM_NTASKS"])
        per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                                   or str(world))
        node = int(env.get("SLURM_NODEID", 0))
        local_world = per_node[node] if node < len(per_node) else per_node[0]
        cpus = env.get("SLURM_CPUS_PER_TASK")
        return JobEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world, *master,
                      launcher="slurm", cpus_per_task=int(cpus) if cpus else None)
    return JobEnv(0, 1, 0, 1, *master, launcher="none")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlmkit.distributed.rendezvous", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (1: loopback)")
    args = p.parse_args(argv)
    if args.nodes < 1:
        print(f"--nodes={args.nodes} must be >= 1", file=sys.stderr)
        return 2
    try:
        addr = "127.0.0.1" if args.nodes == 1 else routable_address()
    except RuntimeError as err:
        print(f"mlmkit rendezvous: {err}", file=sys.stderr)
        return 2
    from mlmkit.distributed.launch import find_free_port

    print(addr, find_free_port(addr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
