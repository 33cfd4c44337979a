"""Check a schedule before anything runs: every error names the rank, the action and the reason.

Pure planning code. Checks, in order:

1. each action is well formed (known kind, microbatch and chunk in range, the right peer: the rank
   that holds the neighbouring virtual stage);
2. each rank runs, for each of its chunks and each microbatch, exactly one F and either one B (a
   full backward) or one I then one W (a split backward), F before the backward;
3. each compute action has its data: a stage's F is preceded by the RECV_ACT of that microbatch
   (except on the first virtual stage, or when the previous stage is on the same rank: the tip of
   a V) and followed by its SEND_ACT (except on the last); likewise B or I with RECV_GRAD /
   SEND_GRAD; where two neighbouring stages share a rank (the tip of a V, or every stage on one
   rank) and hand over without a message, the lower stage's F comes before the upper one's and
   the upper stage's backward (B or I) before the lower one's;
4. a dry run of the send/receive graph (:func:`mlmkit.pipeline.simulate.dry_run`, unit costs):
   nothing deadlocks, nothing is left unreceived, and with ``ordered=True`` (a transport without
   tags: NCCL without batching) every receive gets the message it expects in send order;
5. with ``batched=True`` (NCCL's semantics: sends rendezvous with their receive, tags ignored), the
   batches the executor will post (:func:`mlmkit.pipeline.batching.plan_batches`) complete.
"""

from __future__ import annotations

from mlmkit.pipeline.schedule import COMM, KINDS, Schedule, ScheduleError

__all__ = ["validate"]


def validate(schedule: Schedule, *, batched: bool = False, ordered: bool = False) -> Schedule:
    """Raise :class:`ScheduleError` if ``schedule`` cannot run correctly; return it otherwise.

    ``batched``: also check batched communication under NCCL's semantics (what the executor does
    with ``batch_p2p=True``, its default on NCCL). ``ordered``: messages are matched in send order,
    without tags (the executor's unbatched path on NCCL).
    """
    from mlmkit.pipeline.simulate import Costs, dry_run

    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has action lists for {len(schedule.actions)} ranks but stages={p}")
    last = p * v - 1
    for r, acts in enumerate(schedule.actions):
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(acts):
            _check_action(schedule, r, i, a, last)
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                raise ScheduleError(f"duplicates action #{seen[key]}", rank=r, index=i, action=a)
            seen[key] = i
        for c in range(v):
            vs = schedule.virtual_stage(r, c)
            for mb in range(m):
                _check_microbatch(schedule, r, c, mb, vs, last, seen)
        for c in range(v):
            _check_local_handoffs(schedule, r, c, seen)
    dry_run(schedule, Costs(forward=1.0, backward=1.0, weight=1.0), ordered=ordered)
    if batched:
        from mlmkit.pipeline.batching import plan_batches

        plan_batches(schedule)
    return schedule


def _check_action(schedule: Schedule, r: int, i: int, a, last: int) -> None:
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if a.kind not in KINDS:
        raise ScheduleError(f"unknown action kind {a.kind!r}; expected one of {', '.join(KINDS)}",
                            rank=r, index=i, action=a)
    if not 0 <= a.microbatch < m:
        raise ScheduleError(f"microbatch {a.microbatch} is out of range [0, {m})", rank=r, index=i, action=a)
    if not 0 <= a.chunk < v:
        raise ScheduleError(f"chunk {a.chunk} is out of range [0, {v})", rank=r, index=i, action=a)
    if a.kind in COMM:
        vs = schedule.virtual_stage(r, a.chunk)
        forward_peer = a.kind in ("SEND_ACT", "RECV_GRAD")
        if forward_peer and vs == last:
            raise ScheduleError("the last virtual stage has no next stage to talk to", rank=r, index=i, action=a)
        if not forward_peer and vs == 0:
            raise ScheduleError("the first virtual stage has no previous stage to talk to", rank=r, index=i, action=a)
        want = schedule.rank_of(vs + 1 if forward_peer else vs - 1)[0]
        if want == r:
            raise ScheduleError(
                f"virtual stage {vs} and its {'next' if forward_peer else 'previous'} stage are both on rank {r} "
                f"(the tip of a V): they hand over without a message", rank=r, index=i, action=a)
        if a.peer != want:
            raise ScheduleError(
                f"peer should be rank {want} (virtual stage {vs} talks to the {'next' if forward_peer else 'previous'} "
                f"stage, held by rank {want}), not {a.peer}", rank=r, index=i, action=a)
    elif a.peer is not None:
        raise ScheduleError("a compute action has no peer", rank=r, index=i, action=a)


def _check_microbatch(schedule: Schedule, r: int, c: int, mb: int, vs: int, last: int, seen: dict) -> None:
    acts = schedule.actions[r]

    def where(kind):
        return seen.get((kind, mb, c))

    f, b, i, w = where("F"), where("B"), where("I"), where("W")
    tag = f"microbatch {mb}" + (f", chunk {c}" if schedule.chunks > 1 else "")
    if f is None:
        raise ScheduleError(f"has no forward F for {tag} (the schedule has microbatches={schedule.microbatches}, "
                            f"chunks={schedule.chunks})", rank=r)
    if b is not None and (i is not None or w is not None):
        at = i if i is not None else w
        raise ScheduleError(f"runs both a full backward B (action #{b}) and a split one (I/W) for {tag}",
                            rank=r, index=at, action=acts[at])
    if b is None and i is None:
        if w is not None:
            raise ScheduleError(f"weight gradient W for {tag} without its input-gradient backward I",
                                rank=r, index=w, action=acts[w])
        raise ScheduleError(f"has no backward (B, or I and W) for {tag}", rank=r)
    back = b if b is not None else i
    if back < f:
        raise ScheduleError(f"backward before its forward (the forward is action #{f})", rank=r, index=back,
                            action=acts[back])
    if i is not None:
        if w is None:
            raise ScheduleError(f"has no weight-gradient W for {tag} (its I is action #{i})", rank=r)
        if w < i:
            raise ScheduleError(f"weight gradient before its input-gradient backward (action #{i})", rank=r,
                                index=w, action=acts[w])
    checks = []
    if vs > 0 and schedule.rank_of(vs - 1)[0] != r:
        checks.append(("RECV_ACT", "before", f))
        checks.append(("SEND_GRAD", "after", back))
    if vs < last and schedule.rank_of(vs + 1)[0] != r:
        checks.append(("SEND_ACT", "after", f))
        checks.append(("RECV_GRAD", "before", back))
    for kind, when, anchor in checks:
        pos = where(kind)
        ok = pos is not None and (pos < anchor if when == "before" else pos > anchor)
        if not ok:
            missing = "is missing" if pos is None else f"comes {'after' if when == 'before' else 'before'} it (action #{pos})"
            raise ScheduleError(f"{kind} for {tag} must come {when} this action but {missing}",
                                rank=r, index=anchor, action=acts[anchor])


def _check_local_handoffs(schedule: Schedule, r: int, c: int, seen: dict) -> None:
    # The stage below chunk c's on this same rank hands its output over in memory (no message the
    # dry run could wait for), so this rank's own order must put the producer first.
    vs = schedule.virtual_stage(r, c)
    if vs == 0:
        return
    rank, lower = schedule.rank_of(vs - 1)
    if rank != r:
        return
    acts = schedule.actions[r]
    pair = f"virtual stages {vs - 1} (chunk {lower}) and {vs} (chunk {c}) are both on rank {r}"
    for mb in range(schedule.microbatches):
        f_low, f_up = seen[("F", mb, lower)], seen[("F", mb, c)]
        if f_up < f_low:
            raise ScheduleError(
                f"forward of microbatch {mb}, chunk {c} before the forward it takes its input from (action "
                f"#{f_low}, chunk {lower}): {pair} and hand over in memory, without a message; put chunk "
                f"{lower}'s F first", rank=r, index=f_up, action=acts[f_up])
        b_up = seen.get(("B", mb, c), seen.get(("I", mb, c)))
        b_low = seen.get(("B", mb, lower), seen.get(("I", mb, lower)))
        if b_low < b_up:
            raise ScheduleError(
                f"backward of microbatch {mb}, chunk {lower} before the backward whose input gradient it takes "
                f"(action #{b_up}, chunk {c}): {pair} and hand over in memory, without a message; put chunk "
                f"{c}'s backward first", rank=r, index=b_low, action=acts[b_low])
