"""Random valid pipeline schedules: any order of compute actions that respects the data, drawn by
playing a step out one action at a time (pure, no torch).

The generators make six orders; a user can hand the executor any other (``schedule_from_table``,
``from_torch``), and the validator accepts any that can run. These draws test the executor beside
the six: every order the validator accepts must give the serial model's numbers.
"""

from __future__ import annotations

import os
import random

from mlmkit.pipeline import schedule_from_table
from mlmkit.pipeline.schedule import stage_rank


def seeds_from_env(env: str, default: str) -> list[int]:
    """The seeds a random sweep runs: environment variable ``env`` (else ``default``) as a count
    ``N`` (seeds 0..N-1), a range ``A:B`` or a list ``A,B,C``."""
    spec = os.environ.get(env, default).strip()
    try:
        if ":" in spec:
            a, b = (int(x) for x in spec.split(":"))
            return list(range(a, b))
        if "," in spec:
            return [int(x) for x in spec.split(",")]
        return list(range(int(spec)))
    except ValueError:
        raise ValueError(f"{env}={spec!r}: give a count N, a range A:B or a list A,B,C of seeds") from None


def random_schedule(seed: int, *, stages: int, microbatches: int, chunks: int = 1, placement: str = "loop",
                    split: float = 0.5, eager: float = 0.5, last_in_order: bool = False):
    """A random schedule of ``stages`` ranks: per microbatch and virtual stage a full backward B or,
    with probability ``split``, an I and a later W; the actions in a random order in which each
    action's inputs are computed before it (a step played out one action at a time, the next one
    drawn from every rank's ready actions). ``eager``: the weight of a forward among the ready
    actions (high: GPipe-like, low: 1F1B-like). ``last_in_order``: the last virtual stage runs its
    forwards in microbatch order (what torch's runtime needs: :func:`mlmkit.pipeline.to_torch_csv`)."""
    rng = random.Random(seed)
    p, m, v = stages, microbatches, chunks
    last = p * v - 1
    splits = {(vs, mb): rng.random() < split for vs in range(p * v) for mb in range(m)}
    done: set = set()
    pending = {("F", vs, mb) for vs in range(p * v) for mb in range(m)}
    pending |= {("I" if splits[vs, mb] else "B", vs, mb) for vs in range(p * v) for mb in range(m)}
    pending |= {("W", vs, mb) for vs in range(p * v) for mb in range(m) if splits[vs, mb]}

    def backward_done(vs, mb):
        return ("B", vs, mb) in done or ("I", vs, mb) in done

    def ready(action):
        kind, vs, mb = action
        if kind == "F":
            if last_in_order and vs == last and mb and ("F", vs, mb - 1) not in done:
                return False
            return vs == 0 or ("F", vs - 1, mb) in done
        if kind == "W":
            return ("I", vs, mb) in done
        return ("F", vs, mb) in done and (vs == last or backward_done(vs + 1, mb))

    rows = []
    while pending:
        candidates = sorted(a for a in pending if ready(a))
        weights = [eager if a[0] == "F" else 1.0 - eager for a in candidates]
        kind, vs, mb = rng.choices(candidates, weights=weights)[0] if sum(weights) > 0 else rng.choice(candidates)
        pending.discard((kind, vs, mb))
        done.add((kind, vs, mb))
        rank, chunk = stage_rank(vs, stages=p, placement=placement)
        rows.append({"rank": rank, "kind": kind, "microbatch": mb, "chunk": chunk})
    return schedule_from_table(rows, stages=p, microbatches=m, chunks=v, name=f"random-{seed}",
                               add_communication=True, placement=placement)


def draw_schedule(seed: int, *, stages: int, placements, microbatches, last_in_order: bool = False):
    """``(schedule, rng)``: the seed's random generator picks ``(chunks, placement)`` from
    ``placements``, the microbatches from ``microbatches``, B / I+W and forward- or backward-eagerness,
    then draws the order (:func:`random_schedule`); ``rng`` goes on to draw the rest of a case."""
    rng = random.Random(seed)
    chunks, placement = rng.choice(placements)
    m = rng.choice(microbatches)
    sched = random_schedule(seed, stages=stages, microbatches=m, chunks=chunks, placement=placement,
                            split=rng.choice([0.0, 0.5, 1.0]), eager=rng.choice([0.2, 0.5, 0.8]),
                            last_in_order=last_in_order)
    return sched, rng
