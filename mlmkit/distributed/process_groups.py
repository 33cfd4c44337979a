"""Process groups of one rank, built from a :class:`~mlmkit.topology.Topology`.

Call :func:`init_distributed` (or let the test harness / cluster do it), then
``groups = ProcessGroups.build(topology)`` on every rank, and pass ``groups`` (or just the one
:class:`CommGroup` a function needs) explicitly. Nothing is stored in module globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mlmkit.distributed.comm_group import CommGroup
from mlmkit.topology import Coords, Topology

__all__ = ["ProcessGroups", "default_backend", "default_device", "init_distributed"]


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, ``"gloo"`` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(local_rank: int = 0) -> torch.device:
    """One GPU per rank by local rank when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(*, rank: int, world_size: int, init_method: str, backend: Optional[str] = None,
                     timeout_s: float = 60.0) -> str:
    """``torch.distributed.init_process_group`` with a bounded collective timeout.

    Returns the backend used. ``timeout_s`` bounds every collective of the default group (a rank
    whose peer died raises instead of waiting forever).
    """
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(default_device(int(os.environ.get("LOCAL_RANK", rank))))
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


@dataclass
class ProcessGroups:
    """The groups this rank belongs to, one :class:`CommGroup` per axis.

    Attributes:
        topology: the grid.
        rank: this global rank; ``coords`` its (tp, dp, pp) coordinates.
        tp, dp, pp: this rank's group along each axis.
        embedding: first and last pipeline stage of this replica (``None`` on middle stages).
        world: all ranks.
        device: where this rank's tensors live.
    """

    topology: Topology
    rank: int
    coords: Coords
    tp: CommGroup
    dp: CommGroup
    pp: CommGroup
    embedding: Optional[CommGroup]
    world: CommGroup
    device: torch.device

    @classmethod
    def build(cls, topology: Topology, *, rank: Optional[int] = None, tracer=None,
              device: Optional[torch.device] = None) -> "ProcessGroups":
        """Create every group of ``topology`` (collective: all ranks must call it, in the same order)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroups.build: torch.distributed is not initialised; call "
                "mlmkit.distributed.init_distributed(...) (or run inside mlmkit's harness/cluster) first."
            )
        topology.check_world_size(dist.get_world_size())
        rank = dist.get_rank() if rank is None else rank
        mine: dict[str, CommGroup] = {}
        # new_group is collective over the world: every rank creates every group in the same order.
        for kind in ("tp", "dp", "pp", "embedding"):
            for ranks in topology.groups(kind):
                pg = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine[kind] = CommGroup(axis=kind, ranks=ranks, global_rank=rank, pg=pg, tracer=tracer)
        world = CommGroup(axis="world", ranks=range(topology.world_size), global_rank=rank,
                          pg=dist.group.WORLD, tracer=tracer)
        if device is None:
            device = default_device(int(os.environ.get("LOCAL_RANK", rank)))
        return cls(topology=topology, rank=rank, coords=topology.coords(rank), tp=mine["tp"],
                   dp=mine["dp"], pp=mine["pp"], embedding=mine.get("embedding"), world=world,
                   device=device)

    @classmethod
    def single(cls, *, tracer=None, device: Optional[torch.device] = None) -> "ProcessGroups":
        """Groups for a one-process run (no torch.distributed needed): the serial reference."""
        topo = Topology(tp=1, pp=1, dp=1)
        g = {k: CommGroup(axis=k, ranks=[0], global_rank=0, pg=None, tracer=tracer)
             for k in ("tp", "dp", "pp", "embedding", "world")}
        return cls(topology=topo, rank=0, coords=topo.coords(0), tp=g["tp"], dp=g["dp"], pp=g["pp"],
                   embedding=g["embedding"], world=g["world"], device=device or torch.device("cpu"))

    def set_tracer(self, tracer) -> None:
        """Route every group's collectives to ``tracer`` (``None`` stops recording)."""
        for g in (self.tp, self.dp, self.pp, self.embedding, self.world):
            if g is not None:
                g.tracer = tracer

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    def __repr__(self) -> str:
        c = self.coords
        return (f"ProcessGroups(rank={self.rank}, tp={c.tp}/{self.topology.tp}, dp={c.dp}/{self.topology.dp}, "
                f"pp={c.pp}/{self.topology.pp}, device={self.device})")
