"""The rank grid of a tensor x data x pipeline parallel job.

Pure planning code: no torch, no torch.distributed. A :class:`Topology` answers "which rank holds
which piece?" on the notebook driver before any process starts, and the same object is shipped to
every rank to build its process groups (:mod:`mlmkit.distributed`).

Rank order follows Megatron-LM's default: tensor-parallel rank varies fastest, then data-parallel,
then pipeline-parallel::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so ranks of one TP group are neighbours (on one node, where the fast links are), and each pipeline
stage is a contiguous block of ``tp * dp`` ranks.

Vocabulary: an *axis* is one of ``"tp"``, ``"dp"``, ``"pp"`` (a dimension of the rank grid); the
*embedding* group is a derived group (first and last pipeline stage of one model replica, which both
hold the word embedding when embeddings are tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["AXES", "GROUP_KINDS", "Coords", "Topology"]

#: Axes of the rank grid, fastest-varying first.
AXES: tuple[str, ...] = ("tp", "dp", "pp")
#: Names accepted by :meth:`Topology.groups`.
GROUP_KINDS: tuple[str, ...] = ("tp", "dp", "pp", "embedding")


class Coords(NamedTuple):
    """Coordinates of one rank on the grid."""

    tp: int
    dp: int
    pp: int


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"Topology: {name}={value!r} is not an integer; expected a whole number >= 1 "
            f"(the number of ranks along the {name} axis)."
        )
    if value < 1:
        raise ValueError(
            f"Topology: {name}={value} must be >= 1 (use {name}=1 to switch that axis off)."
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A validated ``tp x dp x pp`` rank grid.

    Args:
        tp: tensor-parallel degree (ranks that split each weight matrix).
        pp: pipeline-parallel degree (stages the layer stack is cut into).
        dp: data-parallel degree (model replicas that see different data).

    Example::

        >>> topo = Topology(tp=2, pp=2, dp=2)
        >>> topo.groups("tp")
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        >>> topo.coords(5)
        Coords(tp=1, dp=0, pp=1)
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            _check_degree(name, getattr(self, name))

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """Number of ranks: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    def size(self, axis: str) -> int:
        """Degree of one axis (``"tp"``, ``"dp"`` or ``"pp"``) or size of the embedding group."""
        self._check_kind(axis)
        if axis == "embedding":
            return 1 if self.pp == 1 else 2
        return getattr(self, axis)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size == tp * pp * dp``."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} does not match {self!r}: tp*pp*dp = "
                f"{self.tp}*{self.pp}*{self.dp} = {self.world_size}. Start {self.world_size} ranks "
                f"or change the degrees so that they multiply to {world_size}."
            )

    # ------------------------------------------------------- rank <-> coords
    def coords(self, rank: int) -> Coords:
        """Grid coordinates ``(tp, dp, pp)`` of ``rank``."""
        self._check_rank(rank)
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coords(tp=tp_rank, dp=dp_rank, pp=pp_rank)

    def rank(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates."""
        for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
            degree = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < degree:
                raise ValueError(
                    f"Topology.rank: {name}={value!r} is out of range; expected an integer in "
                    f"[0, {degree - 1}] for {self}."
                )
        return tp + self.tp * (dp + self.dp * pp)

    # ------------------------------------------------------------------ groups
    def groups(self, kind: str) -> list[list[int]]:
        """All groups along one axis, as lists of ranks (each sorted, the list ordered by first rank).

        ``kind`` is ``"tp"``, ``"dp"``, ``"pp"`` or ``"embedding"`` (first and last pipeline stage
        of each model replica; a single rank when ``pp == 1``).
        """
        self._check_kind(kind)
        if kind == "embedding":
            return [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in self.groups("pp")]
        result = []
        for pp_rank in range(self.pp if kind != "pp" else 1):
            for dp_rank in range(self.dp if kind != "dp" else 1):
                for tp_rank in range(self.tp if kind != "tp" else 1):
                    fixed = {"tp": tp_rank, "dp": dp_rank, "pp": pp_rank}
                    members = []
                    for i in range(getattr(self, kind)):
                        fixed[kind] = i
                        members.append(self.rank(**fixed))
                    result.append(members)
        return sorted(result)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind ``kind`` that contains ``rank`` (for embedding: [] if not a member)."""
        self._check_rank(rank)
        for group in self.groups(kind):
            if rank in group:
                return group
        return []

    # ---------------------------------------------------------------- display
    def to_frame(self):
        """One row per rank: coordinates and the group (as a rank list) of each kind."""
        import pandas as pd

        rows = []
        for r in range(self.world_size):
            c = self.coords(r)
            rows.append(
                {
                    "rank": r,
                    "tp": c.tp,
                    "dp": c.dp,
                    "pp": c.pp,
                    "tp_group": self.group_of("tp", r),
                    "dp_group": self.group_of("dp", r),
                    "pp_group": self.group_of("pp", r),
                    "embedding": bool(self.group_of("embedding", r)),
                }
            )
        return pd.DataFrame(rows).set_index("rank")

    def grid(self) -> str:
        """A text picture: one block per pipeline stage, rows = dp replicas, columns = tp ranks."""
        lines = [repr(self)]
        width = len(str(self.world_size - 1))
        for pp_rank in range(self.pp):
            lines.append(f"  stage pp={pp_rank}")
            for dp_rank in range(self.dp):
                ranks = [self.rank(tp=t, dp=dp_rank, pp=pp_rank) for t in range(self.tp)]
                cells = " ".join(f"{r:>{width}}" for r in ranks)
                lines.append(f"    dp={dp_rank}: [ {cells} ]  (tp across)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()

    def _repr_html_(self) -> str:
        header = f"<b>{self!r}</b> &mdash; world size {self.world_size}"
        return header + self.to_frame()._repr_html_()

    # ---------------------------------------------------------------- checks
    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is out of range for {self!r}: expected an integer in "
                f"[0, {self.world_size - 1}]."
            )

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in GROUP_KINDS:
            raise ValueError(
                f"unknown axis {kind!r}: expected one of {', '.join(map(repr, GROUP_KINDS))}."
            )
