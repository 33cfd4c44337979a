"""Process groups of one rank, built from a :class:`~mlmkit.topology.Topology`.

Call :func:`init_distributed` (or let the test harness / cluster do it), then
``groups = ProcessGroups.build(topology)`` on every rank, and pass ``groups`` (or just the one
:class:`CommGroup` a function needs) explicitly. Nothing is stored in module globals.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mlmkit.distributed.comm_group import CommGroup
from mlmkit.topology import Coords, Topology

__all__ = ["ProcessGroups", "default_backend", "default_device", "init_distributed", "rendezvous_store"]


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, ``"gloo"`` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(local_rank: int = 0, *, backend: Optional[str] = None) -> torch.device:
    """One GPU per rank by local rank when CUDA exists, else the CPU; the CPU for ranks joined by
    gloo (``backend="gloo"``: a CPU run on a machine with GPUs, whose tensors gloo's point-to-point
    messages and reduce-scatters could not take from a GPU)."""
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(*, rank: int, world_size: int, init_method: str, backend: Optional[str] = None,
                     timeout_s: float = 60.0, listen_socket: Optional[socket.socket] = None) -> str:
    """``torch.distributed.init_process_group`` with a bounded collective timeout.

    Returns the backend used. ``timeout_s`` bounds every collective of the default group (a rank
    whose peer died raises instead of waiting forever).

    ``init_method`` is ``"env://"`` (torchrun sets the variables) or ``"tcp://HOST:PORT"``. With
    ``tcp://``, rank 0 binds the rendezvous store to ``HOST`` only (torch's own store listens on
    every interface), and when ``HOST`` is a loopback address gloo's connections are bound to the
    loopback interface too, so a local job opens no port to the network.

    ``listen_socket`` (rank 0, ``tcp://`` only): a socket already bound to ``HOST:PORT`` and
    listening, which the store takes over. Bound before the other ranks are told the port, it lets
    them connect at once: a rank that finds no listener backs off for about half a second before
    it tries again (torch's store client), which rank 0 starting a moment later would cost.
    """
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'gloo' or 'nccl'")
    _import_group_pinning_modules()
    if backend == "nccl":
        torch.cuda.set_device(default_device(int(os.environ.get("LOCAL_RANK", rank))))
    timeout = datetime.timedelta(seconds=timeout_s)
    if not init_method.startswith("tcp://"):
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
        return backend
    host, _, port_text = init_method[len("tcp://"):].rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    if _is_loopback(host) and backend == "gloo":
        # gloo listens on the address its interface resolves to; keep a local job on loopback
        # (a user's own GLOO_SOCKET_IFNAME wins).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    store = rendezvous_store(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                             listen_socket=listen_socket)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return backend


def _import_group_pinning_modules() -> None:
    # torch.optim imports torch._dynamo on first use, which imports FSDP2's modules; that import
    # takes references (from C++) to the process group that exists at that moment, and a group so
    # pinned never closes its connections, even when destroyed. Then a failed rank cannot release
    # peers blocked on it. Imported before any group exists, nothing is pinned.
    import torch._dynamo  # noqa: F401


def listening_socket(host: str, port: int = 0, *, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port the system picks) and listening: what
    rank 0's store serves on (:func:`rendezvous_store`). Connections made before the store starts
    wait in its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))       # "Address already in use" here lets callers retry on a new port
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous_store(*, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                     listen_socket: Optional[socket.socket] = None) -> dist.TCPStore:
    """The TCPStore of a job: rank 0 serves it on ``host:port`` only (on ``listen_socket`` when
    given: bound there and listening), the others connect to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    if listen_socket is not None:
        bound = listen_socket.getsockname()[1]
        if bound != port:
            raise ValueError(f"rendezvous_store: listen_socket is bound to port {bound}, not {port}")
        sock = listen_socket
    else:
        sock = listening_socket(host, port, backlog=max(128, world_size))
    # The store takes the bound socket over (and closes it when it is destroyed).
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_interface() -> str:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


#: The process groups each rank builds: attribute name -> group kind of :meth:`Topology.groups`.
GROUP_ATTRS: dict[str, str] = {
    "tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp", "tp_cp": "tp-cp", "pp": "pp", "embedding": "embedding",
    "ep": "ep", "expert_tp": "expert-tp", "expert_dp": "expert-dp",
}


@dataclass
class ProcessGroups:
    """The groups this rank belongs to, one :class:`CommGroup` per kind.

    Attributes:
        topology: the grid.
        rank: this global rank; ``coords`` its (tp, cp, dp, pp) coordinates.
        tp, cp, dp, pp: this rank's group along each axis of the dense grid.
        dp_cp: the ranks holding the same dense parameters (data x context parallel): gradients
            are averaged and ZeRO shards are cut over it (Megatron-LM's "dp with cp" group).
        tp_cp: the ranks that split one microbatch's tokens (tp with sequence parallelism, times
            cp): a mixture of experts sums its routing statistics over it.
        embedding: first and last pipeline stage of this replica (``None`` on middle stages).
        ep, expert_tp, expert_dp: the expert grid's groups (mixture-of-experts layers).
        world: all ranks.
        device: where this rank's tensors live.

    Groups with the same members share one torch process group (``dp_cp`` is ``dp`` when cp = 1).
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
    cp: Optional[CommGroup] = None
    dp_cp: Optional[CommGroup] = None
    tp_cp: Optional[CommGroup] = None
    ep: Optional[CommGroup] = None
    expert_tp: Optional[CommGroup] = None
    expert_dp: Optional[CommGroup] = None

    def __post_init__(self) -> None:
        # Groups a caller left out are this rank alone (or, for dp_cp, the dp group when cp = 1).
        for name in ("cp", "ep", "expert_tp", "expert_dp"):
            if getattr(self, name) is None:
                setattr(self, name, CommGroup(axis=name, ranks=[self.rank], global_rank=self.rank, pg=None,
                                              tracer=self.tp.tracer))
        if self.dp_cp is None:
            if self.cp.size > 1:
                raise ValueError("ProcessGroups: give dp_cp when cp > 1")
            self.dp_cp = self.dp
        if self.tp_cp is None:
            if self.cp.size > 1:
                raise ValueError("ProcessGroups: give tp_cp when cp > 1")
            self.tp_cp = self.tp

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
        made: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        # new_group is collective over the world: every rank creates every group in the same order.
        experts = topology.experts
        for attr, kind in GROUP_ATTRS.items():
            if attr in ("ep", "expert_tp", "expert_dp") and not experts:
                continue        # a dense model has no expert groups (each is this rank alone)
            for ranks in topology.groups(kind):
                key = tuple(ranks)
                if key not in made:
                    made[key] = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    # The dp-cp group reduces gradients: traced as the data-parallel axis; tp-cp sums
                    # routing statistics of the tokens split over tp and cp.
                    axis = {"dp_cp": "dp", "tp_cp": "tp-cp", "expert_tp": "expert-tp",
                            "expert_dp": "expert-dp"}.get(attr, attr)
                    mine[attr] = CommGroup(axis=axis, ranks=ranks, global_rank=rank, pg=made[key], tracer=tracer)
        world = CommGroup(axis="world", ranks=range(topology.world_size), global_rank=rank,
                          pg=dist.group.WORLD, tracer=tracer)
        if device is None:
            device = default_device(int(os.environ.get("LOCAL_RANK", rank)), backend=dist.get_backend())
        return cls(topology=topology, rank=rank, coords=topology.coords(rank), world=world, device=device,
                   embedding=mine.pop("embedding", None), **mine)

    @classmethod
    def single(cls, *, tracer=None, device: Optional[torch.device] = None) -> "ProcessGroups":
        """Groups for a one-process run (no torch.distributed needed): the serial reference."""
        topo = Topology(tp=1, pp=1, dp=1)
        g = {k: CommGroup(axis=k, ranks=[0], global_rank=0, pg=None, tracer=tracer)
             for k in (*GROUP_ATTRS, "world")}
        g["dp_cp"] = g["dp"]
        g["tp_cp"] = g["tp"]
        return cls(topology=topo, rank=0, coords=topo.coords(0), device=device or torch.device("cpu"), **g)

    def all_groups(self) -> list[CommGroup]:
        """Every distinct group of this rank (world included)."""
        out, seen = [], set()
        for name in (*GROUP_ATTRS, "world"):
            g = getattr(self, name)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                out.append(g)
        return out

    def drop(self) -> None:
        """Forget every torch process group (each :class:`CommGroup` keeps its ranks): with no
        reference left, destroying them closes their connections (peers blocked with us fail fast)."""
        for name in (*GROUP_ATTRS, "world"):
            g = getattr(self, name)
            if g is not None:
                g.pg = None

    def adopt(self, fresh: "ProcessGroups") -> None:
        """Take the torch process groups of ``fresh`` (same topology and rank) into these
        :class:`CommGroup` objects, so models and trainers built on them use the new world."""
        if fresh.topology != self.topology or fresh.rank != self.rank:
            raise ValueError(f"ProcessGroups.adopt: {fresh!r} is not the same rank of the same grid as {self!r}")
        for name in (*GROUP_ATTRS, "world"):
            old, new = getattr(self, name), getattr(fresh, name)
            if (old is None) != (new is None) or (old is not None and list(old.ranks) != list(new.ranks)):
                raise ValueError(f"ProcessGroups.adopt: group {name} differs ({old} vs {new})")
            if old is not None:
                old.pg = new.pg

    def set_tracer(self, tracer) -> None:
        """Route every group's collectives to ``tracer`` (``None`` stops recording)."""
        for g in self.all_groups():
            g.tracer = tracer

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    def expert_groups(self):
        """The groups a mixture-of-experts layer needs (:class:`mlmkit.moe.ExpertGroups`).

        Refuses groups built without the expert grid (``Topology(experts=False)`` with more than one
        replica of each expert): their expert gradients would never be reduced over the replicas."""
        from mlmkit.moe.layer import ExpertGroups

        if self.expert_dp.size != self.topology.expert_dp:
            t = self.topology
            raise ValueError(
                f"a mixture-of-experts model needs the expert grid's process groups, but these were built for "
                f"{t!r} without them (each of the {t.expert_dp} replicas of an expert would keep its own "
                f"gradient): build them from Topology(..., experts=True), as TrainConfig.topology does for a "
                f"model with experts (a Cluster: Cluster(topology=config.topology))")

        return ExpertGroups(ep=self.ep, expert_tp=self.expert_tp, tokens=self.tp_cp)

    def __repr__(self) -> str:
        c, t = self.coords, self.topology
        cp = f", cp={c.cp}/{t.cp}" if t.cp > 1 else ""
        return (f"ProcessGroups(rank={self.rank}, tp={c.tp}/{t.tp}{cp}, dp={c.dp}/{t.dp}, "
                f"pp={c.pp}/{t.pp}, device={self.device})")
