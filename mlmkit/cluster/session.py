"""Interactive training on the cluster: step one schedule action, one microbatch or one step.

A :class:`Session` builds a :class:`~mlmkit.train.trainer.Trainer` on every rank from one
:class:`~mlmkit.train.TrainConfig`, then lets the notebook advance training at three grains:

- :meth:`Session.step_action`: every pipeline rank whose next action can complete without waiting
  takes it (all TP ranks and dp replicas of that stage together, since they run in lockstep); a
  receive whose message has not been sent yet waits for a later call. The driver knows which
  ranks can go from a :class:`~mlmkit.pipeline.ScheduleCursor` (or, with batched communication,
  from the rounds of a :class:`~mlmkit.pipeline.batching.BatchCursor`), so no engine ever blocks.
- :meth:`Session.step_microbatch`: actions until the oldest unfinished microbatch has been through forward
  and backward everywhere (a deferred W of it may come later).
- :meth:`Session.step`: the rest of the step and the optimizer update; returns the metrics.

:meth:`Session.state` shows every rank's position, the activations it holds with their shapes
and its memory so far; :meth:`Session.traces` gathers the traces of every rank.

The session is always in a defined state; training never goes silently wrong:

- **The last finished step is kept.** After every step each rank's state is saved (a checkpoint
  of the session's own, in the cluster's private folder, replaced at every step; or into
  ``checkpoint_dir`` with ``save_every_step=True``, where the session's newest checkpoint replaces
  its previous one and checkpoints it did not write are kept). The save is part of the step (the
  same call to the engines): a step whose save failed is not recorded and is done again from the
  last one saved. ``keep_last_step=False`` saves nothing; then a loss of state raises
  :class:`StateLost` instead of being repaired.
- **A failed step is abandoned on every rank** before the next call: gradients and activations
  dropped, the optimizer never stepped, so the weights are those of the last finished step. If a
  rank failed while the optimizer was changing weights, every rank reloads the last finished step.
- **An engine that died or was stopped** is replaced at the next call, and every rank reloads the
  last finished step (never silently step 0).
- **One step at a time per cluster.** Sessions share the engines' process groups and message
  tags, so while one session is half-way through a step another refuses to run; a session closed
  (or dropped) half-way has the engines re-join a fresh ``torch.distributed`` world, so nothing
  sent in its step reaches the next session. A session dropped without ``close()`` (a notebook cell
  ``session = cluster.session(...)`` run again) has its trainers closed on the engines when the next
  session is made.
- **Ctrl-C** (a kernel interrupt) during a call lets the step in flight finish on every rank and
  records it, then raises KeyboardInterrupt: the next step continues exactly. A second Ctrl-C
  abandons the step instead (the engines are interrupted or, if blocked, replaced) and the next
  call restores the last finished step.
"""

from __future__ import annotations

import numbers
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
import weakref
from typing import Optional

from mlmkit.cluster.cluster import Cluster, RankError
from mlmkit.pipeline import ScheduleCursor
from mlmkit.pipeline.batching import BatchCursor, plan_batches
from mlmkit.pipeline.cursor import unfinished_microbatches
from mlmkit.scalars import plain_bool
from mlmkit.train.config import check_corpus

__all__ = ["Session", "StateLost"]

METRIC_COLUMNS = ["step", "loss", "lr", "grad_norm", "step_time", "tokens_per_s"]


class StateLost(RuntimeError):
    """Training state could not be recovered (no saved step); the session restarted from ``step``."""

    def __init__(self, message: str, *, step: int):
        self.step = step
        super().__init__(message)


# ------------------------------------------------------------------------- engine-side functions
def _build(state, sid, config, source):
    # ``config``: the driver's TrainConfig, pickled. It carries a schedule file's order as the driver
    # read and checked it (an engine reading the file again could find it moved, changed or gone).
    from mlmkit.train.trainer import Trainer

    old = state.trainers.pop(sid, None)
    if old is not None:
        old.abandon_step()
    trainer = Trainer(config, groups=state.groups)
    if source:
        from mlmkit.train.checkpoint import load_checkpoint

        load_checkpoint(trainer, source)
    state.trainers[sid] = state.trainer = trainer
    return {"step": trainer.step, "batch_p2p": trainer.executor.batch_p2p}


def _trainer(state, sid):
    t = state.trainers.get(sid)
    if t is None:
        raise RuntimeError(f"this engine has no trainer for session {sid} (closed, or the engine was replaced)")
    return t


def _begin(state, sid):
    _trainer(state, sid).begin_step()


def _action(state, sid):
    ex = _trainer(state, sid).executor
    a = ex.step_action()
    return None if a is None else ex.last_step


def _finish(state, sid):
    t = _trainer(state, sid)
    while not t.executor.done:
        t.executor.step_action()
    return t.finish_step()


def _whole_step(state, sid, begin, directory, keep):
    """What :meth:`Session.step` asks of each rank, in one call (each call is a round trip through
    the controller: 10-25 ms with 4 engines on 2 cores, a tenth of a small step): begin the step
    unless it was begun by hand, finish it, then save it into ``directory`` (none: nothing kept).
    Returns the step's metrics and the saved checkpoint's path."""
    if begin:
        _begin(state, sid)
    row = _finish(state, sid)
    return row, (_snapshot(state, sid, directory, keep) if directory else None)


def _snapshot(state, sid, directory, keep):
    from mlmkit.train.checkpoint import save_checkpoint

    trainer = _trainer(state, sid)
    with trainer.tracer.paused():        # housekeeping, not training traffic
        return save_checkpoint(trainer, directory, keep=keep)


def _abandon(state, sid):
    import gc

    t = state.trainers.get(sid)
    if t is None:
        return None
    t.abandon_step()
    gc.collect()        # the abandoned graphs' saved activations go now (and leave the memory count)
    return {"step": t.step, "updating": t.updating}


def _close(state, sid):
    t = state.trainers.pop(sid, None)
    if t is not None:
        t.abandon_step()
    if state.trainer is t:
        state.trainer = next(reversed(state.trainers.values()), None) if state.trainers else None


def _state(state, sid):
    t = _trainer(state, sid)
    ex = t.executor
    st = ex.state()
    mem = t.memory
    c = state.groups.coords
    return {"rank": state.rank, "tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp, "step": t.step,
            "position": st.index, "actions": st.total, "next_action": st.next_action,
            "held": st.held, "held_count": len(st.held),
            "activation_bytes": mem.activations if mem else None,
            "parameter_bytes": mem.parameter_bytes() if mem else None,
            "gradient_bytes": mem.gradient_bytes() if mem else None,
            "optimizer_bytes": mem.optimizer_bytes() if mem else None,
            "loss": st.loss}


def _traces(state, sid, clear):
    t = _trainer(state, sid)
    out = t.traces()
    if clear:
        t.clear_traces()
    return out


# ------------------------------------------------------------------------------------ Ctrl-C
class _Interrupts:
    """Defers SIGINT while the session talks to the engines (main thread only): the first Ctrl-C is
    remembered and announced, a second one raises KeyboardInterrupt, but only while waiting for the
    engines (never in the middle of the session's own bookkeeping)."""

    def __init__(self):
        self.hits = 0
        self.waiting = False
        self._depth = 0
        self._old = None

    def handler(self, signum, frame):
        self.hits += 1
        if self.hits == 1:
            print("mlmkit: interrupt requested. The step in flight finishes on every rank and is recorded "
                  "first; interrupt again to abandon it.", file=sys.stderr, flush=True)
        elif self.waiting:
            raise KeyboardInterrupt("mlmkit: the step in flight was abandoned")

    def __enter__(self):
        if self._depth == 0:
            self.hits = 0
            if threading.current_thread() is threading.main_thread():
                self._old = signal.signal(signal.SIGINT, self.handler)
        self._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        self._depth -= 1
        if self._depth == 0 and self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
            if self.hits and exc_type is None:
                raise KeyboardInterrupt("mlmkit: interrupted after the step in flight finished; the session is "
                                        "ready to continue")
        return False


def _check_checkpoint_dir(path, *, save_every_step: bool, model) -> None:
    """ValueError, on the driver before any engine builds a trainer, for a ``checkpoint_dir`` the
    session could not use: not a folder, a checkpoint of another model, nothing to resume from
    when nothing will be saved there (a mistyped path started from step 0 before), or one
    checkpoint's own folder to save into."""
    from mlmkit.train.checkpoint import CheckpointError, check_checkpoint, holds_checkpoint

    where = f"Session: checkpoint_dir={path!r}"
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{where} must be a folder's path (str)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{where} is a file: give a folder of checkpoints (created if missing with "
                         f"save_every_step=True)")
    if save_every_step and os.path.exists(os.path.join(path, "metadata.json")):
        raise ValueError(f"{where} is one checkpoint's folder: to save every step, give the folder that holds it")
    holds = holds_checkpoint(path)
    if holds or not save_every_step:
        try:
            check_checkpoint(os.fspath(path), model)
        except CheckpointError as err:
            fix = "" if holds else " (save_every_step=True starts there from step 0 and saves every step)"
            raise ValueError(f"{where}: {err}{fix}") from None


# ------------------------------------------------------------------------------------ the session
class Session:
    """Step-by-step training on a running :class:`~mlmkit.cluster.Cluster` (see module docstring).

    Args:
        cluster: the running cluster; its topology must be the config's.
        config: the run.
        checkpoint_dir: resume from the checkpoint there (a folder of checkpoints, whose newest is
            taken, or one checkpoint's folder, e.g. a batch job's). Without ``save_every_step`` it
            must hold a checkpoint of this model; checked here, before any engine builds a trainer.
        save_every_step: also write a checkpoint into ``checkpoint_dir`` after every step (it then
            serves as the kept last step; each replaces the session's previous one, and
            checkpoints the session did not write stay); the folder may then be empty or missing.
        keep_last_step: keep the last finished step recoverable (module docstring).
    """

    def __init__(self, cluster: Cluster, config, *, checkpoint_dir: Optional[str] = None, save_every_step: bool = False,
                 keep_last_step: bool = True):
        if config.topology != cluster.topology:
            hint = (": its model has experts, so start the cluster with topology=config.topology (the expert "
                    "grid's process groups)" if config.topology.experts and not cluster.topology.experts else
                    ": change the config's degrees to the cluster's, or start a cluster for it "
                    "(Cluster(topology=config.topology))")
            raise ValueError(f"the config asks for {config.topology!r} but the cluster runs {cluster.topology!r}{hint}")
        check_corpus(config.corpus, seq_len=config.model.seq_len)      # here, not once per engine
        if config.corpus is not None and not os.path.isabs(config.corpus):
            # Engines work in another folder (Slurm and MPI engines in the cluster's own, local
            # ones where the cluster started): a relative path names the driver's file.
            config = config.replace(corpus=os.path.abspath(config.corpus))
        save_every_step, keep_last_step = plain_bool(save_every_step), plain_bool(keep_last_step)
        for name, value in (("save_every_step", save_every_step), ("keep_last_step", keep_last_step)):
            if not isinstance(value, bool):
                raise ValueError(f"Session: {name}={value!r} must be True or False")
        if save_every_step and not checkpoint_dir:
            raise ValueError("Session: save_every_step=True needs a checkpoint_dir to save into")
        if save_every_step and not keep_last_step:
            # It saved nothing: the saves every step are the kept last step, which this turns off.
            raise ValueError("Session: save_every_step=True saves the last step into checkpoint_dir, which "
                             "keep_last_step=False turns off: drop one of the two")
        if checkpoint_dir is not None:
            _check_checkpoint_dir(checkpoint_dir, save_every_step=save_every_step, model=config.model)
            checkpoint_dir = os.path.abspath(checkpoint_dir)    # the engines' working folder may differ
        self.cluster, self.config = cluster, config
        self.id = uuid.uuid4().hex[:8]
        self.checkpoint_dir, self.save_every_step, self.keep_last_step = checkpoint_dir, save_every_step, keep_last_step
        self.schedule = config.pipeline_schedule()
        self._cursor = None
        self.closed = False
        self._claim_cluster()                 # before anything is made that a refusal would leave behind
        self._close_dropped()
        self._snapshot_dir = self._make_snapshot_dir()
        self._written: Optional[str] = None          # the session's last checkpoint in checkpoint_dir
        self.history: list[dict] = []
        self.last_actions: dict[int, Optional[str]] = {}
        self._interrupts = _Interrupts()
        self._dirty = False
        cluster._session_ids.add(self.id)     # before building: a build that fails is cleaned up too
        self._build()
        cluster._sessions[self.id] = self

    # ------------------------------------------------------------------------- one step at a time
    @property
    def cursor(self):
        """Where the step in progress is (``None`` between steps)."""
        return self._cursor

    @cursor.setter
    def cursor(self, value) -> None:
        # The cluster knows which session has a step in progress: its messages may be in flight.
        self._cursor = value
        mid = self.cluster._midstep
        if value is not None:
            self.cluster._midstep = (self.id, weakref.ref(self))
        elif mid is not None and mid[0] == self.id:
            self.cluster._midstep = None

    def _claim_cluster(self) -> None:
        """Before building trainers or beginning a step: no other session may be half-way through
        a step on these engines. Its sends and receives posted but not yet matched would pair with
        this session's (the same process groups and message tags): a hang, or another step's
        activations taken silently. A live one is refused; one that is gone (its Python object
        dropped, e.g. a notebook cell re-run) is dropped on the engines, which re-join a fresh
        ``torch.distributed`` world."""
        mid = self.cluster._midstep
        if mid is None or mid[0] == self.id:
            return
        sid, ref = mid
        other = ref()
        if other is not None and not other.closed:
            raise RuntimeError(f"session {sid} on this cluster has a step in progress: finish it with .step(), drop "
                               f"it with .reset_step(), or .close() it before session {self.id} can run")
        self.cluster._midstep = None
        self.cluster._session_ids.discard(sid)
        if self.cluster.running:
            self.cluster.run(_close, sid)
            self.cluster.rejoin()

    def _close_dropped(self) -> None:
        """Close on the engines the trainers of sessions whose Python objects are gone without
        close() (a notebook cell ``session = cluster.session(...)`` run again): each holds a model,
        its gradients and optimizer state on every engine."""
        known = self.cluster._session_ids
        gone = sorted(sid for sid in known if sid not in self.cluster._sessions)
        if gone and self.cluster.running:
            for sid in gone:
                self.cluster.run(_close, sid)
        known.difference_update(gone)

    # ------------------------------------------------------------------------- state keeping
    def _make_snapshot_dir(self) -> Optional[str]:
        if not self.keep_last_step:
            return None
        if self.save_every_step:
            return self.checkpoint_dir
        base = self.cluster.private_dir
        local = all(self.cluster._is_local(r) for r in range(self.cluster.world_size))
        if base is None or not local:
            # Engines on other hosts must reach it: a private folder in the (shared) home.
            base = os.path.join(os.path.expanduser("~"), ".mlmkit", "sessions")
            os.makedirs(base, mode=0o700, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"session-{self.id}-", dir=base)

    def _snapshot_args(self) -> tuple:
        """Where and how a finished step is saved (:func:`_snapshot`): the session's private folder
        keeps only it; the user's ``checkpoint_dir`` keeps every checkpoint that was there before
        (a batch job's) and, of the session's own, only the newest (see :meth:`_saved`)."""
        return self._snapshot_dir, (1 if self._snapshot_dir != self.checkpoint_dir else None)

    def _saved(self, path: Optional[str]) -> None:
        """A step was saved at ``path``: in the user's ``checkpoint_dir`` the session's previous
        checkpoint goes (all of the session's own but the newest were deleted before)."""
        if path is None or self._snapshot_dir != self.checkpoint_dir:
            return
        previous, self._written = self._written, path
        if previous is not None and os.path.abspath(previous) != os.path.abspath(path):
            shutil.rmtree(previous, ignore_errors=True)

    def _source(self) -> Optional[str]:
        """The newest saved state: the session's kept step, else the user's checkpoint_dir (a folder
        of checkpoints, or one checkpoint)."""
        from mlmkit.train.checkpoint import holds_checkpoint

        for d in (self._snapshot_dir, self.checkpoint_dir):
            if d and holds_checkpoint(d):
                return d
        return None

    def _build(self) -> None:
        """(Re)build the trainers on every rank from the newest saved state."""
        self._generation = self.cluster.generation
        out = self.cluster.run(_build, self.id, self.config, self._source())
        self._generation = self.cluster.generation
        self.step_index = out[0]["step"]
        self.batch_p2p = out[0]["batch_p2p"]
        self.history = [h for h in self.history if h["step"] < self.step_index]
        self.cursor = None
        self._dirty = False

    def _restore(self, why: str) -> None:
        lost = self._source() is None and self.step_index > 0
        before = self.step_index
        self._build()
        if lost:
            raise StateLost(f"{why}; this session keeps no saved step (keep_last_step=False and no checkpoint), "
                            f"so the trainers were rebuilt at step 0: the state of step {before} is lost",
                            step=self.step_index)

    def _recover_if_needed(self) -> None:
        """Before any call: repair the cluster, then bring every rank back to the last finished step."""
        if self.closed:
            raise RuntimeError("this session is closed; start a new one with cluster.session(config)")
        replaced = self.cluster.ensure_healthy()
        if self.cluster.generation != self._generation:
            self._restore(f"engines were replaced (ranks {replaced or 'earlier'})")
            return
        if self._dirty:
            flags = self.cluster.run(_abandon, self.id)
            torn = [r for r, f in flags.items() if f is None or f["updating"]]
            steps = {f["step"] for f in flags.values() if f is not None}
            self.cursor = None
            self._dirty = False
            if torn or steps != {self.step_index}:
                self._restore(f"ranks {torn} failed while the optimizer was updating the weights" if torn else
                              f"the ranks are at step {sorted(steps)}, the session at step {self.step_index} "
                              f"(a step finished on the ranks but was not saved)")

    def _call(self, fn, *args, ranks=None):
        self._recover_if_needed()
        self._interrupts.waiting = True
        try:
            return self.cluster.run(fn, self.id, *args, ranks=ranks)
        except (RankError, KeyboardInterrupt):
            self._dirty = True
            self.cursor = None
            raise
        finally:
            self._interrupts.waiting = False

    # ------------------------------------------------------------------------- stepping
    def _ranks_of_stage(self, pp_rank: int) -> list[int]:
        topo = self.cluster.topology
        return [r for r in range(topo.world_size) if topo.coords(r).pp == pp_rank]

    def _ensure_begun(self) -> None:
        if self.cursor is None:
            self._claim_cluster()
            self._call(_begin)
            self.cursor = self._new_cursor()

    def _new_cursor(self):
        return BatchCursor(plan_batches(self.schedule)) if self.batch_p2p else ScheduleCursor(self.schedule)

    def step_action(self) -> dict:
        """Every pipeline rank that can go takes its next action (with batched communication: its
        next step, a compute action or a batch of sends and receives).

        Returns ``{rank: action taken}`` (``None`` for ranks that waited); :meth:`state` shows more.
        """
        with self._interrupts:
            return self._step_action()

    def _step_action(self) -> dict:
        self._ensure_begun()
        ready = self.cursor.runnable()
        if not ready:
            return {r: None for r in range(self.cluster.world_size)}
        ranks = [r for p in ready for r in self._ranks_of_stage(p)]
        done = self._call(_action, ranks=ranks)
        self.last_actions = {r: done.get(r) for r in range(self.cluster.world_size)}
        if isinstance(self.cursor, BatchCursor):
            self.cursor.advance_round()
        else:
            for p in ready:
                self.cursor.advance(p)
        return dict(self.last_actions)

    @property
    def step_done(self) -> bool:
        """Every action of the current step has run (the optimizer update is still to come)."""
        return self.cursor is not None and self.cursor.done

    def step_microbatch(self):
        """Actions until the oldest unfinished microbatch has been through forward and backward on
        every rank. A zero-bubble schedule's W of it (deferred to fill a bubble, possibly to the
        drain) does not count; once only W actions are left, until the oldest one's W has run."""
        with self._interrupts as interrupts:
            self._ensure_begun()
            left = unfinished_microbatches(self.cursor, weights=False)
            weights = not left                               # only W actions left: run those
            if weights:
                left = unfinished_microbatches(self.cursor)
            if not left:
                return self.state()
            target = min(left)
            while target in unfinished_microbatches(self.cursor, weights=weights):
                self._step_action()
                if interrupts.hits:
                    break
        return self.state()

    def step(self) -> dict:
        """Finish the current step (or run a whole one) and update the weights. Returns its metrics."""
        with self._interrupts:
            return self._step()

    def _step(self) -> dict:
        by_hand = self.cursor is not None          # begun by step_action/step_microbatch
        if not by_hand:
            self._claim_cluster()
            self._recover_if_needed()              # before the cursor says a step is in progress
            self.cursor = self._new_cursor()
        # begin (unless begun by hand), the rest of the actions, the update and the save: one call
        row, path = self._call(_whole_step, not by_hand, *self._snapshot_args())[0]
        if by_hand:
            # Its wall time is the notebook's pace between actions, not the step's: no number.
            row = dict(row, step_time=float("nan"), tokens_per_s=float("nan"))
        self.cursor = None
        self.history.append(row)
        self.step_index = row["step"] + 1
        self._saved(path)
        return row

    def train(self, steps: int, *, progress: bool = True):
        """``steps`` whole steps; returns the metrics DataFrame (tqdm progress bar in notebooks).

        Ctrl-C stops after the step in flight (recorded); a second Ctrl-C abandons it."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"Session.train: steps={steps!r} must be an integer >= 0")
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc="train", unit="step")
        try:
            with self._interrupts as interrupts:
                for _ in range(steps):
                    row = self._step()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{row['loss']:.4f}")
                    if interrupts.hits:
                        break
        finally:
            if bar is not None:
                bar.close()
        return self.metrics()

    def reset_step(self) -> None:
        """Abandon the step in progress on every rank (no weight update). Activations held for the
        step are freed; a step left half-way may have messages in flight between ranks, so every
        rank then re-joins a fresh ``torch.distributed`` world (a second or two) and the next step
        starts clean."""
        with self._interrupts:
            midstep = self.cursor is not None
            self._dirty = True
            self._recover_if_needed()
            if midstep:
                self.cluster.rejoin()
            self.cursor = None

    def close(self) -> None:
        """Drop this session's trainers on the engines and its kept step. Closed half-way through a
        step, the engines then re-join a fresh ``torch.distributed`` world (as :meth:`reset_step`
        does), so that nothing sent in the dropped step reaches another session."""
        if self.closed:
            return
        midstep = self.cursor is not None
        self.cluster._session_ids.discard(self.id)
        try:
            if self.cluster.running:
                self.cluster.run(_close, self.id)
                if midstep:
                    self.cluster.rejoin()
        finally:
            self.cursor = None
            self.closed = True
            if self._snapshot_dir and self._snapshot_dir != self.checkpoint_dir:
                shutil.rmtree(self._snapshot_dir, ignore_errors=True)

    # ------------------------------------------------------------------------- reading
    def state(self):
        """One row per rank: step, position in the schedule, next action, held activations, bytes."""
        import pandas as pd

        rows = self._call(_state)
        df = pd.DataFrame([rows[r] for r in sorted(rows)]).set_index("rank")
        if self.last_actions:
            df.insert(5, "last_action", [self.last_actions.get(r) for r in df.index])
        if self.cursor is not None:
            df["can_step"] = [self.cursor.can_step(df.loc[r, "pp"]) for r in df.index]
        return df

    def metrics(self):
        """One row per finished step: step, loss, lr, grad_norm, step_time (s), tokens_per_s (and
        the MoE columns). A step run action by action (:meth:`step_action`, :meth:`step_microbatch`)
        has no step_time or tokens_per_s (NaN): its wall time is the pace of the notebook."""
        import pandas as pd

        columns = METRIC_COLUMNS + (["aux_loss", "dropped"] if self.config.model.moe else [])
        return pd.DataFrame(self.history, columns=columns)

    def traces(self, *, clear: bool = False) -> dict:
        """Every rank's traces merged (:func:`mlmkit.trace.export.merge_traces`): ``events``,
        ``comm``, ``memory``, ``ring``, ``moe`` DataFrames, ``t0`` and ``clock`` (``"wall"`` when
        the engines run on several hosts). Rows of every step since the last ``clear=True`` (each
        with its ``step``); ``clear=True`` empties the engines' traces after reading them."""
        from mlmkit.trace.export import merge_traces

        per_rank = self._call(_traces, clear)
        return merge_traces(per_rank[r] for r in sorted(per_rank))

    def __repr__(self) -> str:
        pos = repr(self.cursor) if self.cursor else "between steps"
        return (f"Session({self.config.topology!r}, schedule={self.config.schedule}, step={self.step_index}, "
                f"steps recorded={len(self.history)}, {pos})")
