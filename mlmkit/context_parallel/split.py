"""Which tokens each context-parallel rank holds, and what it attends to at each ring step.

Pure planning code (no torch): the model uses :func:`held_positions` to pick its tokens, ring
attention uses :func:`ring_steps` to decide which query rows meet which key/value columns, and the
figures, the estimator and the simulator use the same functions to draw and count the work.

With causal attention a token attends to every earlier token, so the last tokens of a sequence do
the most work. Cutting the sequence into ``cp`` contiguous pieces (``split="naive"``) leaves rank 0
with one small triangle and the last rank with ``cp - 1`` full squares and a triangle: the ring
waits for its slowest rank. Megatron-LM and TransformerEngine cut it into ``2 cp`` chunks instead
and give rank ``i`` chunks ``i`` and ``2 cp - 1 - i`` (``split="balanced"``): an early and a late
chunk, so every rank does the same work (Liu et al. 2023, Ring Attention; Brandon et al. 2023,
Striped Attention discuss the same imbalance).

Vocabulary: the sequence has ``s`` positions cut into *chunks* of ``s / (2 cp)`` (balanced) or
``s / cp`` (naive) positions; at ring step ``j`` rank ``r`` holds the keys and values of rank
``(r - j) mod cp`` (step 0: its own); a *segment* is a block of (query rows, key columns) computed
together, ``full`` (no mask) or ``causal`` (mask by position).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = ["SPLITS", "Segment", "attention_work", "check_split", "chunk_count", "held_chunks",
           "held_positions", "ring_steps", "simulate_ring"]

#: How the sequence is divided over the cp ranks.
SPLITS = ("balanced", "naive")


def chunk_count(cp: int, split: str = "balanced") -> int:
    """Chunks the sequence is cut into: ``2 cp`` (balanced) or ``cp`` (naive)."""
    if split not in SPLITS:
        raise ValueError(f"cp_split={split!r}: expected one of {', '.join(map(repr, SPLITS))}")
    return 2 * cp if split == "balanced" else cp


def check_split(seq_len: int, cp: int, split: str = "balanced", *, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Raise ValueError unless ``seq_len`` divides into the chunks (and, with sequence parallelism,
    each rank's part divides by tp)."""
    for name, value in (("seq_len", seq_len), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"context parallelism: {name}={value!r} must be an integer >= 1")
    n = chunk_count(cp, split)
    need = n * (tp if sequence_parallel and tp > 1 else 1)
    if seq_len % need:
        what = f"2*cp={n}" if split == "balanced" else f"cp={n}"
        if need != n:
            what += f" times tp={tp} (sequence parallelism splits each rank's part again)"
        raise ValueError(
            f"context parallelism: seq_len={seq_len} is not divisible by {what}; choose a seq_len that is a "
            f"multiple of {need}, or another cp."
        )


def held_chunks(cp: int, rank: int, split: str = "balanced") -> tuple[int, ...]:
    """Chunk indices rank ``rank`` of ``cp`` holds, in sequence order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is out of range for cp={cp}")
    n = chunk_count(cp, split)
    return (rank, n - 1 - rank) if split == "balanced" else (rank,)


def held_positions(seq_len: int, cp: int, rank: int, split: str = "balanced") -> list[int]:
    """Sequence positions rank ``rank`` holds, in the order of its local sequence (ValueError
    unless ``seq_len`` divides into the chunks: the positions past the last whole chunk were held
    by nobody, silently)."""
    check_split(seq_len, cp, split)
    n = chunk_count(cp, split)
    c = seq_len // n
    return [p for i in held_chunks(cp, rank, split) for p in range(i * c, (i + 1) * c)]


@dataclass(frozen=True)
class Segment:
    """One block of attention work at a ring step.

    ``rows``/``cols``: local indices (into the local query sequence and the held key/value block)
    as ``(start, stop)``; ``causal``: mask by position (query may only see keys at or before it);
    ``pairs``: the (query, key) pairs actually used (unmasked), the unit of work counted."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    causal: bool
    pairs: int


def _pieces(chunks: tuple[int, ...], c: int) -> list[tuple[int, tuple[int, int]]]:
    # (chunk index, local (start, stop)) of each held chunk
    return [(k, (i * c, (i + 1) * c)) for i, k in enumerate(chunks)]


def ring_steps(seq_len: int, cp: int, rank: int, split: str = "balanced") -> list[tuple[int, list[Segment]]]:
    """For each ring step ``j = 0 .. cp-1``: ``(source rank, segments)``, the rank whose keys and
    values are held at that step and the blocks computed with them.

    A query chunk sees a key chunk fully when it comes later in the sequence, causally when it is
    the same chunk, not at all when it comes earlier. Blocks that form one full rectangle are
    merged into one segment; a step with a same-chunk block (step 0) is one causal segment over the
    whole local sequence (positions keep their order, so the position mask is exact)."""
    check_split(seq_len, cp, split)
    n = chunk_count(cp, split)
    c = seq_len // n
    mine = _pieces(held_chunks(cp, rank, split), c)
    steps = []
    for j in range(cp):
        src = (rank - j) % cp
        theirs = _pieces(held_chunks(cp, src, split), c)
        used = [(qi, qr, ki, kr) for qi, qr in mine for ki, kr in theirs if ki <= qi]
        if not used:
            steps.append((src, []))
            continue
        rows = (min(u[1][0] for u in used), max(u[1][1] for u in used))
        cols = (min(u[3][0] for u in used), max(u[3][1] for u in used))
        q_chunks = {u[0] for u in used}
        k_chunks = {u[2] for u in used}
        rectangle = len(used) == len(q_chunks) * len(k_chunks) and all(ki < qi for qi, _, ki, _ in used) \
            and rows[1] - rows[0] == c * len(q_chunks) and cols[1] - cols[0] == c * len(k_chunks)
        if rectangle:
            segs = [Segment(rows=rows, cols=cols, causal=False, pairs=(rows[1] - rows[0]) * (cols[1] - cols[0]))]
        elif any(ki == qi for qi, _, ki, _ in used) and rows == (0, c * len(mine)) and cols == (0, c * len(theirs)):
            pairs = sum(c * c if ki < qi else c * (c + 1) // 2 for qi, _, ki, _ in used)
            segs = [Segment(rows=rows, cols=cols, causal=True, pairs=pairs)]
        else:   # general case: one segment per block
            segs = [Segment(rows=qr, cols=kr, causal=ki == qi, pairs=c * c if ki < qi else c * (c + 1) // 2)
                    for qi, qr, ki, kr in used]
        steps.append((src, segs))
    return steps


def attention_work(seq_len: int, cp: int, split: str = "balanced") -> list[int]:
    """(query, key) pairs each cp rank computes over a whole ring: equal for ``"balanced"``."""
    return [sum(seg.pairs for _, segs in ring_steps(seq_len, cp, r, split) for seg in segs) for r in range(cp)]


def simulate_ring(seq_len: int, cp: int, split: str = "balanced", *, layers: int = 1, pair_time: float = 1.0,
                  step_overhead: float = 0.0, message_time: float = 0.0) -> list[dict]:
    """Forward ring attention of ``layers`` consecutive layers on a simple clock: returns one row per
    (rank, layer, step) with ``start``/``end`` of its compute, like a ``ring`` trace.

    Costs: a step computes its (query, key) pairs at ``pair_time`` each, plus ``step_overhead``; a
    block sent at the start of a step arrives ``message_time`` later. A rank starts step ``j + 1``
    when it finished step ``j`` and the block from its predecessor arrived (that rank sends it when
    it starts its step ``j``); a layer starts when the rank finished the previous one. Ranks with
    less work wait: the idle time the naive split shows."""
    if layers < 1:
        raise ValueError(f"simulate_ring: layers={layers} must be >= 1")
    plans = [ring_steps(seq_len, cp, r, split) for r in range(cp)]
    free = [0.0] * cp                   # when each rank finished its previous work
    rows = []
    for layer in range(layers):
        start = [[0.0] * cp for _ in range(cp)]   # start[j][r]
        for j in range(cp):
            for r in range(cp):
                if j == 0:
                    t = free[r]
                else:
                    prev = (r - 1) % cp                   # it sent this block when it started step j - 1
                    t = max(free[r], start[j - 1][prev] + message_time)
                start[j][r] = t
                src, segs = plans[r][j]
                pairs = sum(s.pairs for s in segs)
                end = t + pairs * pair_time + step_overhead
                free[r] = end
                rows.append({"rank": r, "layer": layer, "step": j, "src": src, "pairs": pairs,
                             "start": t, "end": end})
    return rows
