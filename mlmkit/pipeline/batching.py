"""Batched point-to-point communication: NCCL's semantics, and a plan of batches that cannot deadlock.

Pure planning code. With NCCL, mlmkit posts communication as *batches*: the sends and receives of
one batch are launched together (``torch.distributed.batch_isend_irecv``) and the rank waits for
the whole batch before its next action, as Megatron-LM's ``send_forward_recv_backward`` & co. do.
Two facts of NCCL make batching delicate, and :func:`check_batches` models both:

1. **Rendezvous.** A send completes only when the peer has posted the matching receive in a batch
   that is running at the same time (NCCL's kernels for both sides must run together), and a batch
   completes only when every one of its operations has. A send posted alone, while the peer first
   waits for something else, blocks its rank (gloo's sends, by contrast, never block).
2. **Order, not tags.** NCCL ignores tags: the k-th message sent from rank A to rank B is received
   by the k-th receive that B posts from A. With pp=2 and interleaving, a rank's previous and next
   stage are the same peer, and an activation and a gradient of equal shapes travel on the same
   channel: a receiver that posts them in the other order gets them swapped, silently.

The old rule, "consecutive communication actions form one batch", deadlocks for interleaved 1F1B
with more microbatches than stages (the ranks' batches do not pair up). :func:`plan_batches`
builds batches that provably complete under the model above, by

- posting each receive in the order its sender sends (a receive may be posted early, never late),
- pulling a receive into the batch that is running when its sender already waits for it (the peer
  receives *ahead*, as Megatron-LM's combined calls do), and
- splitting a batch whose operations cannot all complete together, so that batches pair up
  exactly: every batch completes in one *round* together with its peers' counterparts.

The rounds also tell a driver that steps ranks in lockstep (the notebook's step button) which
ranks can go together without any rank blocking (:class:`BatchCursor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from mlmkit.pipeline.schedule import COMPUTE, Action, Schedule, ScheduleError

__all__ = ["BatchCursor", "BatchPlan", "Step", "check_batches", "natural_batches", "plan_batches"]


@dataclass(frozen=True)
class Step:
    """One item of a rank's batched execution: a compute action, or a batch of communication actions.

    ``actions`` are indices into the rank's action list, in the order they are posted; ``round`` is
    the lockstep round in which the step runs (every batch completes in its round).
    """

    actions: tuple[int, ...]
    round: int = -1

    def is_compute(self, acts: Sequence[Action]) -> bool:
        return len(self.actions) == 1 and acts[self.actions[0]].kind in COMPUTE


@dataclass(frozen=True)
class BatchPlan:
    """Per rank, the steps of one training step under batched communication (see module docstring)."""

    schedule: Schedule
    steps: tuple[tuple[Step, ...], ...]

    @property
    def rounds(self) -> int:
        return 1 + max((s.round for steps in self.steps for s in steps), default=-1)

    def describe(self, rank: int) -> list[str]:
        """Each step of ``rank`` as text: ``F(mb=0)`` or ``[SEND_ACT(mb=0, to rank 1) + RECV_GRAD(...)]``."""
        acts = self.schedule.actions[rank]
        out = []
        for st in self.steps[rank]:
            if st.is_compute(acts):
                out.append(str(acts[st.actions[0]]))
            else:
                out.append("[" + " + ".join(str(acts[i]) for i in st.actions) + "]")
        return out

    def to_frame(self):
        """One row per action: rank, round, step (position on its rank), index (in the schedule), action."""
        import pandas as pd

        rows = []
        for r, steps in enumerate(self.steps):
            for k, st in enumerate(steps):
                for i in st.actions:
                    rows.append({"rank": r, "round": st.round, "step": k, "index": i,
                                 "action": str(self.schedule.actions[r][i])})
        return pd.DataFrame(rows, columns=["rank", "round", "step", "index", "action"])


# ----------------------------------------------------------------------------------- messages
class _Messages:
    """Channel and sequence number of every communication action (the sender's order defines them)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.seq: dict[tuple[int, int], int] = {}        # (rank, index) -> sequence number on its channel
        self.channel: dict[tuple[int, int], tuple[int, int]] = {}
        self.counterpart: dict[tuple[int, int], tuple[int, int]] = {}
        by_key: dict[tuple, tuple[int, int]] = {}
        count: dict[tuple[int, int], int] = {}
        for r, acts in enumerate(schedule.actions):
            for i, a in enumerate(acts):
                if a.kind.startswith("SEND"):
                    ch = (r, a.peer)
                    self.seq[(r, i)] = count.get(ch, 0)
                    count[ch] = count.get(ch, 0) + 1
                    self.channel[(r, i)] = ch
                    by_key[(ch, schedule.message(r, a))] = (r, i)
        for r, acts in enumerate(schedule.actions):
            for i, a in enumerate(acts):
                if a.kind.startswith("RECV"):
                    ch = (a.peer, r)
                    send = by_key.get((ch, schedule.message(r, a)))
                    if send is None:
                        raise ScheduleError("no rank sends the message this receive expects",
                                            rank=r, index=i, action=a)
                    self.channel[(r, i)] = ch
                    self.seq[(r, i)] = self.seq[send]
                    self.counterpart[(r, i)] = send
                    self.counterpart[send] = (r, i)
        for (r, i) in self.seq:
            if (r, i) not in self.counterpart:
                a = schedule.actions[r][i]
                raise ScheduleError(f"is never received: rank {a.peer} has no matching receive",
                                    rank=r, index=i, action=a)


def natural_batches(schedule: Schedule) -> list[list[list[int]]]:
    """The old rule: each compute action alone, each run of consecutive communication actions one batch."""
    out = []
    for acts in schedule.actions:
        steps: list[list[int]] = []
        for i, a in enumerate(acts):
            if a.kind in COMPUTE or not steps or acts[steps[-1][-1]].kind in COMPUTE:
                steps.append([i])
            else:
                steps[-1].append(i)
        out.append(steps)
    return out


# ----------------------------------------------------------------------------------- the model
def check_batches(schedule: Schedule, batches: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Run ``batches`` (per rank, lists of action indices) under NCCL's semantics (module docstring).

    Each rank runs its steps in order; a batch completes when every operation in it has met its
    counterpart in a batch running at the same time on the peer (partial progress is allowed: an
    operation that met its counterpart is done even if its batch is not). Messages on a channel are
    matched in posting order, and the matched receive must expect that very message.

    Returns the round in which each step completed (per rank). Raises :class:`ScheduleError` on a
    deadlock or on a receive that would get another message than it expects.
    """
    msgs = _Messages(schedule)
    p = schedule.stages
    acts = schedule.actions
    pos = [0] * p
    posted_count: dict[tuple[int, int, str], int] = {}    # (channel, side) -> ops posted so far
    posted_seq: dict[tuple[int, int], int] = {}           # (rank, index) -> position among posted on its channel side
    done: set[tuple[int, int]] = set()
    rounds: list[list[int]] = [[-1] * len(b) for b in batches]
    current_posted: list[Optional[int]] = [None] * p     # step index whose ops are posted
    rnd = 0
    while any(pos[r] < len(batches[r]) for r in range(p)):
        progress = False
        # Post the head step of every rank (computes complete at once).
        for r in range(p):
            while pos[r] < len(batches[r]):
                step = batches[r][pos[r]]
                if len(step) == 1 and acts[r][step[0]].kind in COMPUTE:
                    rounds[r][pos[r]] = rnd
                    pos[r] += 1
                    progress = True
                    continue
                if current_posted[r] != pos[r]:
                    current_posted[r] = pos[r]
                    for i in step:
                        a = acts[r][i]
                        side = "send" if a.kind.startswith("SEND") else "recv"
                        ch = msgs.channel[(r, i)]
                        k = posted_count.get((*ch, side), 0)
                        posted_count[(*ch, side)] = k + 1
                        posted_seq[(r, i)] = k
                break
        # Match posted operations: the k-th posted send on a channel meets the k-th posted receive.
        for r in range(p):
            if pos[r] >= len(batches[r]):
                continue
            for i in batches[r][pos[r]]:
                if (r, i) in done:
                    continue
                a = acts[r][i]
                if not a.kind.startswith("RECV"):
                    continue
                k = posted_seq[(r, i)]
                ch = msgs.channel[(r, i)]
                src = a.peer
                if src is None or pos[src] >= len(batches[src]):
                    continue
                for j in batches[src][pos[src]]:
                    if (src, j) in done or not acts[src][j].kind.startswith("SEND"):
                        continue
                    if msgs.channel[(src, j)] == ch and posted_seq[(src, j)] == k:
                        if msgs.counterpart[(r, i)] != (src, j):
                            raise ScheduleError(
                                f"would receive {acts[src][j]} (rank {src}'s action #{j}) instead of the message "
                                f"it expects: without tags (NCCL), messages between rank {src} and rank {r} are "
                                f"matched in the order they are posted", rank=r, index=i, action=a)
                        done.update({(r, i), (src, j)})
                        progress = True
        for r in range(p):
            if pos[r] < len(batches[r]) and all((r, i) in done for i in batches[r][pos[r]]):
                rounds[r][pos[r]] = rnd
                pos[r] += 1
                progress = True
        if not progress:
            waits = "; ".join(
                f"rank {r} waits in batch [" + ", ".join(str(acts[r][i]) for i in batches[r][pos[r]]
                                                          if (r, i) not in done) + "]"
                for r in range(p) if pos[r] < len(batches[r]))
            r0 = next(r for r in range(p) if pos[r] < len(batches[r]))
            i0 = next(i for i in batches[r0][pos[r0]] if (r0, i) not in done)
            raise ScheduleError(f"deadlock with batched communication (NCCL semantics): {waits}",
                                rank=r0, index=i0, action=acts[r0][i0])
        rnd += 1
    return rounds


# ----------------------------------------------------------------------------------- the plan
def plan_batches(schedule: Schedule) -> BatchPlan:
    """Batches for ``schedule`` that complete under NCCL's semantics, with their lockstep rounds.

    Starts from :func:`natural_batches`, posts receives in their sender's order, then replays the
    model round by round: a send that waits for a receive the peer has not posted yet pulls that
    receive into the peer's running batch; a batch whose operations cannot all complete in this
    round is split (the rest is posted right after). Raises :class:`ScheduleError` if the schedule
    deadlocks whatever the batching (its data dependencies form a cycle).
    """
    msgs = _Messages(schedule)
    p, acts = schedule.stages, schedule.actions
    steps = [[list(s) for s in rank_steps] for rank_steps in natural_batches(schedule)]
    for r in range(p):
        _order_receives(steps[r], r, acts[r], msgs)

    def is_compute(r, step):
        return len(step) == 1 and acts[r][step[0]].kind in COMPUTE

    pos = [0] * p
    rounds: list[list[int]] = [[] for _ in range(p)]
    done: set[tuple[int, int]] = set()
    rnd = 0
    while any(pos[r] < len(steps[r]) for r in range(p)):
        # 1. Computes at the head run this round.
        #    A rank takes at most one step per round.
        busy = set()
        for r in range(p):
            if pos[r] < len(steps[r]) and is_compute(r, steps[r][pos[r]]):
                rounds[r].append(rnd)
                pos[r] += 1
                busy.add(r)
        ran = bool(busy)
        heads = {r: steps[r][pos[r]] for r in range(p) if r not in busy and pos[r] < len(steps[r])
                 and not is_compute(r, steps[r][pos[r]])}
        posted = {(r, i) for r, st in heads.items() for i in st}
        # 2. A send whose receive is not posted pulls it (and earlier receives of its channel) forward.
        #    Only where the receiving rank sits at a batch this round (a rank busy computing posts later).
        pulled = False
        for r, st in heads.items():
            for i in st:
                if not acts[r][i].kind.startswith("SEND"):
                    continue
                dst, j = msgs.counterpart[(r, i)]
                if (dst, j) in posted or dst not in heads:
                    continue
                _pull(steps[dst], pos[dst], j, dst, acts[dst], msgs)
                heads[dst] = steps[dst][pos[dst]]
                posted = {(q, k) for q, s in heads.items() for k in s}
                pulled = True
        # 3. Split every head batch into what meets its counterparts now and the rest.
        completed = False
        for r, st in list(heads.items()):
            now = [i for i in st if msgs.counterpart[(r, i)] in posted]
            rest = [i for i in st if msgs.counterpart[(r, i)] not in posted]
            if not now:
                continue
            steps[r][pos[r]] = now
            if rest:
                steps[r].insert(pos[r] + 1, rest)
        # After splitting, the batches made only of matched operations complete together.
        for r, st in heads.items():
            st = steps[r][pos[r]]
            if all(msgs.counterpart[(r, i)] in posted for i in st):
                done.update((r, i) for i in st)
                rounds[r].append(rnd)
                pos[r] += 1
                completed = True
        if not (ran or completed or pulled):
            waits = "; ".join(f"rank {r} waits for [" + ", ".join(str(acts[r][i]) for i in st) + "]"
                              for r, st in heads.items())
            r0 = min(heads)
            raise ScheduleError(f"deadlock with batched communication: {waits}",
                                rank=r0, index=heads[r0][0], action=acts[r0][heads[r0][0]])
        if ran or completed:
            rnd += 1
    plan = BatchPlan(schedule=schedule, steps=tuple(
        tuple(Step(actions=tuple(st), round=rounds[r][k]) for k, st in enumerate(steps[r])) for r in range(p)))
    # Independent checks of the construction: the plan passes the model it was built for, and every
    # batch's counterparts run in the same round (what lockstep stepping relies on).
    check_batches(schedule, [[list(s.actions) for s in rank_steps] for rank_steps in plan.steps])
    round_of = {(r, i): s.round for r in range(p) for s in plan.steps[r] for i in s.actions}
    for (r, i), other in msgs.counterpart.items():
        if round_of[(r, i)] != round_of[other]:
            raise AssertionError(f"batch plan: rank {r}'s {acts[r][i]} runs in round {round_of[(r, i)]} but its "
                                 f"counterpart in round {round_of[other]}")
    return plan


def _order_receives(steps: list[list[int]], rank: int, acts: Sequence[Action], msgs: _Messages) -> None:
    """Make every channel's receives appear in their sender's order: a receive whose predecessors on
    its channel come in later steps pulls them into its own step (just before it)."""
    k = 0
    while k < len(steps):
        st = steps[k]
        for i in list(st):
            if not acts[i].kind.startswith("RECV"):
                continue
            ch, seq = msgs.channel[(rank, i)], msgs.seq[(rank, i)]
            earlier = [(msgs.seq[(rank, j)], j, kk) for kk in range(k + 1, len(steps)) for j in steps[kk]
                       if acts[j].kind.startswith("RECV") and msgs.channel[(rank, j)] == ch
                       and msgs.seq[(rank, j)] < seq]
            for _, j, kk in sorted(earlier):
                steps[kk].remove(j)
                st.insert(st.index(i), j)
        _sort_step(st, rank, acts, msgs)
        k += 1
    steps[:] = [s for s in steps if s]


def _pull(steps: list[list[int]], at: int, index: int, rank: int, acts: Sequence[Action], msgs: _Messages) -> None:
    """Move receive ``index`` (and every earlier receive of its channel still ahead) into step ``at``."""
    ch, seq = msgs.channel[(rank, index)], msgs.seq[(rank, index)]
    moving = [(kk, j) for kk in range(at + 1, len(steps)) for j in steps[kk]
              if acts[j].kind.startswith("RECV") and msgs.channel[(rank, j)] == ch and msgs.seq[(rank, j)] <= seq]
    for kk, j in moving:
        steps[kk].remove(j)
        steps[at].append(j)
    _sort_step(steps[at], rank, acts, msgs)
    steps[:] = [s for s in steps if s]


def _sort_step(step: list[int], rank: int, acts: Sequence[Action], msgs: _Messages) -> None:
    # Sends first in schedule order, then receives by (channel, sequence): the posting order.
    if any(acts[i].kind in COMPUTE for i in step):
        return
    step.sort(key=lambda i: (0, i, 0) if acts[i].kind.startswith("SEND")
              else (1, msgs.channel[(rank, i)][0], msgs.seq[(rank, i)]))


# ----------------------------------------------------------------------------------- lockstep
class BatchCursor:
    """Lockstep stepping of a :class:`BatchPlan`: each call to :meth:`advance_round` lets every rank
    with a step in the current round take it (a compute, or a batch whose counterparts run in the
    same round, so no rank blocks)."""

    def __init__(self, plan: BatchPlan):
        self.plan = plan
        self.schedule = plan.schedule
        self.pos = [0] * plan.schedule.stages
        self.round = 0

    def runnable(self) -> list[int]:
        rounds = self.plan.rounds
        while self.round < rounds:
            ready = [r for r in range(self.schedule.stages)
                     if self.pos[r] < len(self.plan.steps[r]) and self.plan.steps[r][self.pos[r]].round == self.round]
            if ready:
                return ready
            self.round += 1
        return []

    def can_step(self, rank: int) -> bool:
        return rank in self.runnable()

    def advance_round(self) -> list[int]:
        """Record that every runnable rank took its step; returns those ranks."""
        ready = self.runnable()
        for r in ready:
            self.pos[r] += 1
        self.round += 1
        return ready

    def remaining(self, rank: int) -> list[Action]:
        acts = self.schedule.actions[rank]
        return [acts[i] for st in self.plan.steps[rank][self.pos[rank]:] for i in st.actions]

    def next_action(self, rank: int) -> Optional[Action]:
        rest = self.remaining(rank)
        return rest[0] if rest else None

    @property
    def done(self) -> bool:
        return all(p == len(s) for p, s in zip(self.pos, self.plan.steps))

    def __repr__(self) -> str:
        pos = ", ".join(f"r{r}:{i}/{len(s)}" for r, (i, s) in enumerate(zip(self.pos, self.plan.steps)))
        return f"BatchCursor({self.schedule.name}: round {self.round}, {pos})"
