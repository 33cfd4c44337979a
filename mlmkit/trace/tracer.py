"""The per-rank recorder behind every traced collective and schedule action."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

__all__ = ["COMM_COLUMNS", "EVENT_COLUMNS", "MOE_COLUMNS", "RING_COLUMNS", "Tracer", "ring_wire_bytes"]

#: Columns of :meth:`Tracer.comm_frame`. ``bytes`` is the size of the logical tensor the operation
#: is about (the all-reduced tensor, the gathered output, the reduce-scattered input, the message);
#: ``wire_bytes`` is what this rank sends with a ring algorithm (see :func:`ring_wire_bytes`);
#: ``step``: the optimizer step the row belongs to (:attr:`Tracer.step`).
COMM_COLUMNS = (
    "rank", "op", "axis", "ranks", "bytes", "wire_bytes", "start", "end", "site", "phase", "step",
)
#: Columns of :meth:`Tracer.event_frame` (schedule actions), with the optimizer step of each.
EVENT_COLUMNS = ("rank", "action", "microbatch", "chunk", "start", "end", "step")
#: Columns of :meth:`Tracer.ring_frame`: one row per ring-attention step (context parallelism):
#: the layer's site, forward or backward, the ring step (``step`` here, not the optimizer step of
#: the other frames), the cp rank whose keys/values were used
#: (``src``, an index in the cp group), the (query, key) pairs computed, and the compute time.
RING_COLUMNS = ("rank", "site", "phase", "step", "src", "pairs", "start", "end")
#: Columns of :meth:`Tracer.moe_frame`: one row per mixture-of-experts layer call on a rank: the
#: assignments this rank's tokens routed to each expert (``routed``, a list over all experts) and
#: kept after the capacity (``kept``), the rows each local expert computed (``received``), the
#: dropped assignments, and the microbatch's load-balancing and z losses (already weighted).
MOE_COLUMNS = ("rank", "site", "call", "routed", "kept", "received", "dropped", "aux_loss", "z_loss")


def ring_wire_bytes(op: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` with a ring algorithm.

    all-reduce: 2(n-1)/n * N (reduce-scatter then all-gather); all-gather and reduce-scatter:
    (n-1)/n * N where N is the full (gathered) size; point-to-point: N; n == 1: nothing.
    """
    n = group_size
    if op in ("send", "all_to_all"):
        return nbytes
    if op == "recv" or n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * nbytes // n
    if op == "broadcast":
        return nbytes
    raise ValueError(f"ring_wire_bytes: unknown op {op!r}")


class Tracer:
    """Collects this rank's rows. ``enabled=False`` makes every ``record_*`` a no-op.

    Schedule actions and communication are tagged with :attr:`step`, the optimizer step the trainer
    is in (it sets it when a step begins): a trace kept over several steps is read per step (the
    time between steps, the driver's or the user's, is no pipeline bubble).
    """

    def __init__(self, *, rank: int, enabled: bool = True, clock: Callable[[], float] = time.perf_counter):
        self.rank = rank
        self.enabled = enabled
        self.clock = clock
        self.phase = ""  # free label written into comm rows (e.g. "forward"/"backward")
        self.step = 0    # the optimizer step written into event and comm rows
        self.comm: list[tuple] = []
        self.events: list[tuple] = []
        self.ring: list[tuple] = []
        self.moe: list[tuple] = []
        self._moe_calls: dict[str, int] = {}
        self._mark: Optional[tuple] = None

    def record_comm(self, *, op: str, axis: str, ranks: tuple[int, ...], nbytes: int,
                    wire_bytes: int, start: float, end: float, site: str, phase: str = "") -> None:
        if self.enabled:
            self.comm.append((self.rank, op, axis, ranks, nbytes, wire_bytes, start, end, site,
                              phase or self.phase, self.step))

    def record_event(self, *, action: str, microbatch: int, chunk: int, start: float, end: float) -> None:
        if self.enabled:
            self.events.append((self.rank, action, microbatch, chunk, start, end, self.step))

    def record_ring(self, *, site: str, phase: str, step: int, src: int, pairs: int, start: float,
                    end: float) -> None:
        if self.enabled:
            self.ring.append((self.rank, site, phase, step, src, pairs, start, end))

    def record_moe(self, *, site: str, routed: list, kept: list, received: list, dropped: int, aux_loss: float,
                   z_loss: float) -> None:
        if self.enabled:
            call = self._moe_calls.get(site, 0)             # this site's calls so far (a count, not a scan)
            self._moe_calls[site] = call + 1
            self.moe.append((self.rank, site, call, routed, kept, received, dropped, aux_loss, z_loss))

    def clear(self) -> None:
        self.comm.clear()
        self.events.clear()
        self.ring.clear()
        self.moe.clear()
        self._moe_calls.clear()
        if self._mark is not None:
            self._mark = (0, 0, 0, 0, {})      # a step in progress: its rows so far are gone too

    def mark(self) -> None:
        """Remember where the rows stand (a step begins), for :meth:`rewind`."""
        self._mark = (len(self.comm), len(self.events), len(self.ring), len(self.moe), dict(self._moe_calls))

    def rewind(self) -> None:
        """Drop every row recorded since :meth:`mark` (an abandoned step: it is run again from its
        start, and its partial rows would read as part of that step)."""
        if self._mark is None:
            return
        comm, events, ring, moe, calls = self._mark
        del self.comm[comm:], self.events[events:], self.ring[ring:], self.moe[moe:]
        self._moe_calls = calls
        self._mark = None

    def unmark(self) -> None:
        """The step finished: its rows stay."""
        self._mark = None

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside the block (housekeeping that is not training, e.g. a snapshot)."""
        was, self.enabled = self.enabled, False
        try:
            yield self
        finally:
            self.enabled = was

    def comm_frame(self):
        import pandas as pd

        return pd.DataFrame(self.comm, columns=list(COMM_COLUMNS))

    def event_frame(self):
        import pandas as pd

        return pd.DataFrame(self.events, columns=list(EVENT_COLUMNS))

    def ring_frame(self):
        import pandas as pd

        return pd.DataFrame(self.ring, columns=list(RING_COLUMNS))

    def moe_frame(self):
        import pandas as pd

        return pd.DataFrame(self.moe, columns=list(MOE_COLUMNS))

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"Tracer(rank={self.rank}, {state}, comm={len(self.comm)}, events={len(self.events)})"
