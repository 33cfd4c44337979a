"""The rank grid of a tensor x context x data x pipeline (x expert) parallel job.

Pure planning code: no torch, no torch.distributed. A :class:`Topology` answers "which rank holds
which piece?" on the notebook driver before any process starts, and the same object is shipped to
every rank to build its process groups (:mod:`mlmkit.distributed`).

Rank order follows Megatron-LM's default order ``"tp-cp-ep-dp-pp"``: the tensor-parallel rank varies
fastest, then the context-parallel rank, then the data-parallel rank, then the pipeline stage::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so ranks of one TP group are neighbours (on one node, where the fast links are), a cp group is a
block of ``tp * cp`` ranks, and each pipeline stage is a contiguous block of ``tp * cp * dp`` ranks.

Mixture-of-experts layers use a second grid over the same ranks (Megatron-Core's "expert" rank
generator): within a pipeline stage the ``tp * cp * dp`` ranks are re-read as
``expert_tp x ep x expert_dp``, expert-tensor rank fastest. Experts are split over ``ep`` ranks and
each expert's weights over ``expert_tp`` ranks; ``expert_dp = tp * cp * dp / (expert_tp * ep)``
replicas of each expert reduce their gradients together.

Vocabulary: an *axis* is one of ``tp``, ``cp``, ``dp``, ``pp`` (dense grid) or ``ep`` plus the
expert grid's ``expert-tp`` and ``expert-dp``. A *group kind* names the axes that vary inside a
group, joined by ``-`` as Megatron-Core names them: ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``,
``"dp-cp"`` (data parallel with context parallel: the ranks that hold the same dense parameters and
reduce their gradients together), ``"tp-cp"``, ``"tp-dp-cp"``, ...; ``"ep"``, ``"expert-tp"``,
``"expert-dp"``, ``"expert-tp-ep"``; and the derived ``"embedding"`` group (first and last pipeline
stage of one model replica, which both hold the word embedding when embeddings are tied).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

from mlmkit.scalars import plain_bool

__all__ = ["AXES", "EXPERT_AXES", "GROUP_KINDS", "Coords", "ExpertCoords", "Topology"]

#: Axes of the dense rank grid, fastest-varying first (Megatron-LM's "tp-cp-ep-dp-pp" with ep=1).
AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")
#: Axes of the expert grid, fastest-varying first (Megatron-Core's expert rank generator).
EXPERT_AXES: tuple[str, ...] = ("tp", "ep", "dp", "pp")
#: The group kinds most code asks for (any ``-``-joined set of one grid's axes is accepted).
GROUP_KINDS: tuple[str, ...] = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "embedding",
                                "ep", "expert-tp", "expert-dp", "expert-tp-ep")


class Coords(NamedTuple):
    """Coordinates of one rank on the dense grid."""

    tp: int
    cp: int
    dp: int
    pp: int


class ExpertCoords(NamedTuple):
    """Coordinates of one rank on the expert grid (``tp`` is the expert-tensor rank, ``dp`` the
    expert-data-parallel rank)."""

    tp: int
    ep: int
    dp: int
    pp: int


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):   # a numpy integer is one
        raise ValueError(
            f"Topology: {name}={value!r} is not an integer; expected a whole number >= 1 "
            f"(the number of ranks along the {name} axis)."
        )
    if value < 1:
        raise ValueError(
            f"Topology: {name}={value} must be >= 1 (use {name}=1 to switch that axis off)."
        )
    return int(value)


def _ranks_of(sizes: list[int], varying: list[bool]) -> list[list[int]]:
    # Groups of a mixed-radix grid (first axis fastest) whose members differ only along the varying
    # axes; each group in rank order, groups ordered by their first rank (Megatron-Core's order).
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    fixed = [i for i, v in enumerate(varying) if not v]
    free = [i for i, v in enumerate(varying) if v]

    def offsets(axes: list[int]) -> list[int]:
        out = [0]
        for i in axes:                                   # later axes have larger strides
            out = [o + k * strides[i] for k in range(sizes[i]) for o in out]
        return out

    inner = offsets(free)
    return [sorted(base + o for o in inner) for base in sorted(offsets(fixed))]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A validated rank grid: ``tp x cp x dp x pp`` ranks, with experts laid over it.

    Args:
        tp: tensor-parallel degree (ranks that split each weight matrix).
        cp: context-parallel degree (ranks that split each sequence; ring attention).
        pp: pipeline-parallel degree (stages the layer stack is cut into).
        dp: data-parallel degree (model replicas that see different data).
        ep: expert-parallel degree (ranks that split the experts of a mixture-of-experts layer).
        expert_tp: tensor-parallel degree inside each expert.
        experts: the model has mixture-of-experts layers, so the expert grid's groups exist even at
            ``ep = expert_tp = 1`` (then ``expert-dp`` is all ``tp * cp * dp`` ranks of a stage:
            every one holds every expert and computes its gradients on its own tokens). Set by
            itself when ``ep`` or ``expert_tp`` is above 1; ``TrainConfig.topology`` sets it from
            the model.

    Example::

        >>> topo = Topology(tp=2, cp=2, pp=2)
        >>> topo.groups("cp")
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> topo.coords(5)
        Coords(tp=1, cp=0, dp=0, pp=1)
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1
    experts: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "ep", "expert_tp"):
            object.__setattr__(self, name, _check_degree(name, getattr(self, name)))
        object.__setattr__(self, "experts", plain_bool(self.experts))      # numpy's bool too
        if not isinstance(self.experts, bool):
            raise ValueError(f"Topology: experts={self.experts!r} must be True or False")
        if self.ep > 1 or self.expert_tp > 1:
            object.__setattr__(self, "experts", True)
        dense = self.tp * self.cp * self.dp
        if dense % (self.expert_tp * self.ep):
            fits = [e for e in range(1, dense + 1) if dense % (e * self.expert_tp) == 0]
            fix = (f"With expert_tp={self.expert_tp}, choose ep in {fits}, or raise dp." if fits else
                   f"No ep fits expert_tp={self.expert_tp}: make tp x cp x dp a multiple of "
                   f"{self.ep * self.expert_tp} (e.g. dp={self.dp * self.ep * self.expert_tp}), or lower expert_tp.")
            raise ValueError(
                f"Topology: ep={self.ep} x expert_tp={self.expert_tp} = {self.ep * self.expert_tp} does not divide "
                f"tp x cp x dp = {self.tp}x{self.cp}x{self.dp} = {dense}: the expert ranks of a pipeline stage fold "
                f"its dense ranks (Megatron-Core's expert grid). {fix}"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """Number of ranks: ``tp * cp * dp * pp``."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: ``tp * cp * dp / (expert_tp * ep)``."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def size(self, kind: str) -> int:
        """Number of ranks in one group of ``kind`` (e.g. ``"dp-cp"`` -> ``dp * cp``)."""
        if kind == "embedding":
            return 1 if self.pp == 1 else 2
        grid, axes = self._parse(kind)
        sizes = self._sizes(grid)
        return prod(sizes[a] for a in axes)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size == tp * cp * dp * pp``."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} does not match {self!r}: tp*cp*dp*pp = "
                f"{self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size}. Start {self.world_size} ranks "
                f"or change the degrees so that they multiply to {world_size}."
            )

    # ------------------------------------------------------- rank <-> coords
    def coords(self, rank: int) -> Coords:
        """Dense-grid coordinates ``(tp, cp, dp, pp)`` of ``rank``."""
        self._check_rank(rank)
        rank = int(rank)      # a numpy integer (a DataFrame's index) gives Python ints
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return Coords(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)

    def expert_coords(self, rank: int) -> ExpertCoords:
        """Expert-grid coordinates ``(expert_tp, ep, expert_dp, pp)`` of ``rank``."""
        self._check_rank(rank)
        rank = int(rank)      # a numpy integer (a DataFrame's index) gives Python ints
        et, ep = self.expert_tp, self.ep
        return ExpertCoords(tp=rank % et, ep=(rank // et) % ep, dp=(rank // (et * ep)) % self.expert_dp,
                            pp=rank // (et * ep * self.expert_dp))

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given dense-grid coordinates."""
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            degree = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < degree:
                raise ValueError(
                    f"Topology.rank: {name}={value!r} is out of range; expected an integer in "
                    f"[0, {degree - 1}] for {self}."
                )
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    # ------------------------------------------------------------------ groups
    def groups(self, kind: str) -> list[list[int]]:
        """All groups of one kind, as lists of ranks (each sorted, the list ordered by first rank).

        ``kind`` names the axes that vary inside a group, ``-``-joined in any order: ``"tp"``,
        ``"cp"``, ``"dp"``, ``"pp"``, ``"dp-cp"``, ``"tp-cp"``, ...; on the expert grid ``"ep"``,
        ``"expert-tp"``, ``"expert-dp"``, ``"expert-tp-ep"``, ...; or ``"embedding"`` (first and last
        pipeline stage of each model replica; a single rank when ``pp == 1``).
        """
        if kind == "embedding":
            return [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in self.groups("pp")]
        grid, axes = self._parse(kind)
        names = AXES if grid == "dense" else EXPERT_AXES
        sizes = self._sizes(grid)
        return _ranks_of([sizes[n] for n in names], [n in axes for n in names])

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind ``kind`` that contains ``rank`` (for embedding: [] if not a member)."""
        self._check_rank(rank)
        rank = int(rank)      # a numpy integer (a DataFrame's index) gives Python ints
        for group in self.groups(kind):
            if rank in group:
                return group
        return []

    # ---------------------------------------------------------------- display
    def to_frame(self):
        """One row per rank: coordinates and the group (as a rank list) of each kind."""
        import pandas as pd

        kinds = ["tp", "cp", "dp", "pp"] + (["dp-cp"] if self.cp > 1 else [])
        expert = self.experts
        if expert:
            kinds += ["ep", "expert-tp", "expert-dp"]
        members = {k: {r: g for g in self.groups(k) for r in g} for k in kinds}
        rows = []
        for r in range(self.world_size):
            c = self.coords(r)
            row = {"rank": r, "tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp}
            if expert:
                e = self.expert_coords(r)
                row.update({"ep": e.ep, "expert_tp": e.tp, "expert_dp": e.dp})
            for k in kinds:
                row[f"{k.replace('-', '_')}_group"] = members[k][r]
            row["embedding"] = bool(self.group_of("embedding", r))
            rows.append(row)
        return pd.DataFrame(rows).set_index("rank")

    def grid(self) -> str:
        """A text picture: one block per pipeline stage, rows = dp replicas, columns = tp ranks
        (one bracket per cp rank when cp > 1)."""
        lines = [repr(self)]
        width = len(str(self.world_size - 1))
        for pp_rank in range(self.pp):
            lines.append(f"  stage pp={pp_rank}")
            for dp_rank in range(self.dp):
                blocks = []
                for cp_rank in range(self.cp):
                    ranks = [self.rank(tp=t, cp=cp_rank, dp=dp_rank, pp=pp_rank) for t in range(self.tp)]
                    blocks.append("[ " + " ".join(f"{r:>{width}}" for r in ranks) + " ]")
                note = "(tp across" + (", one block per cp rank)" if self.cp > 1 else ")")
                lines.append(f"    dp={dp_rank}: {' '.join(blocks)}  {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1 or self.expert_tp > 1:
            parts += [f"ep={self.ep}"] + ([f"expert_tp={self.expert_tp}"] if self.expert_tp > 1 else [])
        elif self.experts:
            parts.append("experts=True")
        return f"Topology({', '.join(parts)})"

    def __str__(self) -> str:
        return self.grid()

    def _repr_html_(self) -> str:
        header = f"<b>{self!r}</b> &mdash; world size {self.world_size}"
        return header + self.to_frame()._repr_html_()

    # ---------------------------------------------------------------- checks
    def _sizes(self, grid: str) -> dict[str, int]:
        if grid == "dense":
            return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        return {"tp": self.expert_tp, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}

    @staticmethod
    def _parse(kind: str) -> tuple[str, set[str]]:
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"unknown group kind {kind!r}: expected one of {', '.join(map(repr, GROUP_KINDS))}")
        grid, text = "dense", kind
        if kind == "ep":
            grid, text = "expert", "ep"
        elif kind.startswith("expert-"):
            grid, text = "expert", kind[len("expert-"):]
        tokens = text.split("-")
        allowed = AXES if grid == "dense" else EXPERT_AXES
        if any(t not in allowed for t in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError(
                f"unknown group kind {kind!r}: expected one of {', '.join(map(repr, GROUP_KINDS))}, or axes of "
                f"one grid joined by '-' (dense: {', '.join(AXES)}; expert, after 'expert-': "
                f"{', '.join(EXPERT_AXES)})."
            )
        return grid, set(tokens)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is out of range for {self!r}: expected an integer in "
                f"[0, {self.world_size - 1}]."
            )
