"""Lockstep stepping without blocking: which rank can take its next action now?

Pure planning code. A driver (the notebook session) that steps every rank one action at a time
must never ask a rank to receive a message its peer has not sent yet: that rank would block inside
the call, and the driver with it. :class:`ScheduleCursor` follows every rank's position in the
schedule and answers :meth:`~ScheduleCursor.can_step`: compute actions and sends always can; a
receive can once the peer has executed the send of *that* message (:meth:`Schedule.message`: what,
microbatch, sending virtual stage). Counting messages per pair of ranks is not enough: on gloo the
executor's messages carry tags, and a schedule may receive the messages of one channel in another
order than they were sent (zb-v at pp=4: rank 3 gets activations and gradients from rank 2), so
"rank 2 has sent more than rank 3 received" does not mean the message rank 3 waits for has left.
"""

from __future__ import annotations

from typing import Optional

from mlmkit.pipeline.schedule import Action, Schedule

__all__ = ["ScheduleCursor", "unfinished_microbatches"]


class ScheduleCursor:
    """Positions of all ranks in one step of ``schedule``."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.index = [0] * schedule.stages
        self._sent: set[tuple[str, int, int]] = set()       # messages sent so far (Schedule.message)

    def next_action(self, rank: int) -> Optional[Action]:
        acts = self.schedule.actions[rank]
        return acts[self.index[rank]] if self.index[rank] < len(acts) else None

    def can_step(self, rank: int) -> bool:
        a = self.next_action(rank)
        if a is None:
            return False
        if a.kind.startswith("RECV"):
            return self.schedule.message(rank, a) in self._sent
        return True

    def remaining(self, rank: int) -> list[Action]:
        """The actions ``rank`` has not taken yet."""
        return list(self.schedule.actions[rank][self.index[rank]:])

    def runnable(self) -> list[int]:
        """Ranks whose next action completes without waiting for anyone."""
        return [r for r in range(self.schedule.stages) if self.can_step(r)]

    def advance(self, rank: int) -> Action:
        """Record that ``rank`` executed its next action."""
        if not self.can_step(rank):
            raise RuntimeError(f"rank {rank} cannot take {self.next_action(rank)} yet")
        a = self.next_action(rank)
        if a.kind.startswith("SEND"):
            self._sent.add(self.schedule.message(rank, a))
        self.index[rank] += 1
        return a

    @property
    def done(self) -> bool:
        return all(i == len(a) for i, a in zip(self.index, self.schedule.actions))

    def __repr__(self) -> str:
        pos = ", ".join(f"r{r}:{i}/{len(a)}" for r, (i, a) in enumerate(zip(self.index, self.schedule.actions)))
        return f"ScheduleCursor({self.schedule.name}: {pos})"


def unfinished_microbatches(cursor, *, weights: bool = True) -> set[int]:
    """Microbatches with an action left on some rank (``cursor``: a :class:`ScheduleCursor` or a
    :class:`~mlmkit.pipeline.batching.BatchCursor`); with ``weights=False`` their W actions do not
    count. What stepping "one microbatch" runs to
    (:meth:`mlmkit.cluster.Session.step_microbatch`): a zero-bubble schedule defers W to fill
    bubbles, up to the drain (zb-h1 gives each W slot the freshest microbatch), so counting W would
    make the first microbatch's stepping run most of the step."""
    return {a.microbatch for r in range(cursor.schedule.stages) for a in cursor.remaining(r)
            if weights or a.kind != "W"}
