"""One process group along one axis of the grid, whose collectives report to a tracer.

Every collective mlmkit issues goes through a :class:`CommGroup`, so that the operation, the axis,
the peer ranks and the bytes are recorded where they happen, not estimated afterwards. A group of
size 1 performs no communication and records nothing.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from mlmkit.trace import ring_wire_bytes

if TYPE_CHECKING:
    from mlmkit.trace import Tracer

__all__ = ["CommGroup", "RingShift"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommGroup:
    """A process group along ``axis`` containing ``ranks`` (global ranks, in group order).

    Args:
        axis: ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``, ``"embedding"``, ``"ep"``, ... or ``"world"``.
        ranks: the global ranks of the group; this rank's position in it is :attr:`rank`.
        global_rank: this process's global rank.
        pg: the torch process group (``None`` for a group of size 1).
        tracer: where collectives are recorded (``None``: not recorded).
    """

    def __init__(self, *, axis: str, ranks: Sequence[int], global_rank: int,
                 pg: Optional[dist.ProcessGroup], tracer: Optional["Tracer"] = None):
        if global_rank not in ranks:
            raise ValueError(f"CommGroup({axis}): rank {global_rank} is not in {list(ranks)}")
        self.axis = axis
        self.ranks = tuple(ranks)
        self.global_rank = global_rank
        self.pg = pg
        self.tracer = tracer

    @classmethod
    def single(cls, axis: str = "tp", *, tracer: Optional["Tracer"] = None) -> "CommGroup":
        """A group of one rank (no communication): what serial code passes where a group is expected."""
        return cls(axis=axis, ranks=[0], global_rank=0, pg=None, tracer=tracer)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index within the group."""
        return self.ranks.index(self.global_rank)

    def __repr__(self) -> str:
        return f"CommGroup({self.axis}, ranks={list(self.ranks)}, me={self.global_rank})"

    # ------------------------------------------------------------- tracing
    def _record(self, op: str, nbytes: int, start: float, site: str, peers=None, wire=None,
                phase: str = "") -> None:
        tr = self.tracer
        if tr is None or not tr.enabled:
            return
        tr.record_comm(
            phase=phase,
            op=op, axis=self.axis, ranks=tuple(peers) if peers is not None else self.ranks,
            nbytes=nbytes,
            wire_bytes=ring_wire_bytes(op, nbytes, self.size) if wire is None else wire,
            start=start, end=tr.clock(), site=site,
        )

    def _now(self) -> float:
        return self.tracer.clock() if self.tracer is not None else 0.0

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", site: str = "", phase: str = "") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` (``op``: "sum", "max" or "min"); returns it."""
        if self.size == 1:
            return tensor
        start = self._now()
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.pg)
        self._record("all_reduce", _nbytes(tensor), start, site, phase=phase)
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, dim: int = 0, site: str = "", phase: str = "") -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (group order)."""
        if self.size == 1:
            return tensor
        start = self._now()
        dim = dim % tensor.dim()
        src = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
        out = torch.empty((src.shape[0] * self.size, *src.shape[1:]), dtype=src.dtype, device=src.device)
        _all_gather_single(out, src, group=self.pg)
        out = out.movedim(0, dim) if dim != 0 else out
        self._record("all_gather", _nbytes(out), start, site, phase=phase)
        return out.contiguous()

    def reduce_scatter(self, tensor: torch.Tensor, *, dim: int = 0, site: str = "", phase: str = "") -> torch.Tensor:
        """Sum ``tensor`` over the group and keep this rank's slice along ``dim``."""
        if self.size == 1:
            return tensor
        start = self._now()
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"reduce_scatter on {self.axis}: dimension {dim} of shape {tuple(tensor.shape)} "
                f"is not divisible by the group size {self.size}"
            )
        src = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
        out = torch.empty((src.shape[0] // self.size, *src.shape[1:]), dtype=src.dtype, device=src.device)
        _reduce_scatter_single(out, src, group=self.pg)
        self._record("reduce_scatter", _nbytes(tensor), start, site, phase=phase)
        return (out.movedim(0, dim) if dim != 0 else out).contiguous()

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, site: str = "", phase: str = "") -> torch.Tensor:
        """In place: every rank gets the tensor of group member ``src`` (an index in the group)."""
        if self.size == 1:
            return tensor
        start = self._now()
        dist.broadcast(tensor, src=self.ranks[src], group=self.pg)
        self._record("broadcast", _nbytes(tensor), start, site,
                     wire=_nbytes(tensor) if self.rank == src else 0, phase=phase)
        return tensor

    def all_to_all(self, tensor: torch.Tensor, *, send_splits: Sequence[int], recv_splits: Sequence[int],
                   site: str = "", phase: str = "") -> torch.Tensor:
        """Rows ``send_splits[j]`` of ``tensor`` (in order) go to member ``j``; returns the rows every
        member sent here, concatenated in member order (``recv_splits[j]`` from member ``j``).
        Traced as one row per peer (op ``all_to_all``, ``ranks`` = (this rank, peer), the bytes sent
        to that peer): the all-to-all matrix of a step can be read off the trace."""
        if self.size == 1:
            return tensor
        send_splits, recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
        if len(send_splits) != self.size or sum(send_splits) != tensor.shape[0]:
            raise ValueError(f"all_to_all on {self.axis}: send_splits={send_splits} must have {self.size} entries "
                             f"summing to the {tensor.shape[0]} rows of the input")
        start = self._now()
        src = tensor.contiguous()
        out = torch.empty((sum(recv_splits), *src.shape[1:]), dtype=src.dtype, device=src.device)
        dist.all_to_all_single(out, src, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                               group=self.pg)
        row = math.prod(src.shape[1:]) * src.element_size()        # bytes per row (an empty input has rows too)
        for j, n in enumerate(send_splits):
            if j != self.rank:
                self._record("all_to_all", n * row, start, site, peers=(self.global_rank, self.ranks[j]),
                             wire=n * row, phase=phase)
        return out

    def ring_shift(self, tensor: torch.Tensor, *, site: str = "", phase: str = "", tag: int = 0) -> "RingShift":
        """Send ``tensor`` to the next member of the ring and receive the previous member's tensor of
        the same shape, without waiting: returns a :class:`RingShift` whose ``wait()`` gives the
        received tensor. Both messages are posted as one batch (safe under NCCL, where two ranks
        sending to each other in separate calls could block). ``tag`` keeps two kinds of
        messages in flight at once apart (on gloo; NCCL matches them in posting order)."""
        n = self.size
        if n == 1:
            raise ValueError(f"ring_shift on {self.axis}: a group of one rank has no ring")
        me = self.rank
        nxt, prv = self.ranks[(me + 1) % n], self.ranks[(me - 1) % n]
        send = tensor.contiguous()
        recv = torch.empty_like(send)
        start = self._now()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, self.pg, tag),
                                        dist.P2POp(dist.irecv, recv, prv, self.pg, tag)])
        return RingShift(self, works, send, recv, start, site, phase, nxt, prv)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)


class RingShift:
    """A posted :meth:`CommGroup.ring_shift`; ``wait()`` returns the received tensor (once)."""

    def __init__(self, group: CommGroup, works, send, recv, start, site, phase, nxt, prv):
        self.group, self.works, self.send, self.recv = group, works, send, recv
        self.start, self.site, self.phase, self.nxt, self.prv = start, site, phase, nxt, prv

    def wait(self) -> torch.Tensor:
        # The receive first when each operation has its own work (gloo; NCCL may give one for the
        # batch): a receive from a peer that failed fails at once, while a send to a peer that
        # failed just after posting its receive can stay queued in gloo until the group's timeout
        # (PipelineExecutor.wait_sends explains it), so a rank whose ring broke is released.
        for w in (reversed(self.works) if len(self.works) == 2 else self.works):
            w.wait()
        g, n = self.group, _nbytes(self.recv)
        g._record("send", n, self.start, self.site, peers=(g.global_rank, self.nxt), wire=n, phase=self.phase)
        g._record("recv", n, self.start, self.site, peers=(g.global_rank, self.prv), wire=0, phase=self.phase)
        self.send = None
        return self.recv
