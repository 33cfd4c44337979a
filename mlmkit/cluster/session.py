"""Interactive training on the cluster: step one schedule action, one microbatch or one step.

A :class:`Session` builds a :class:`~mlmkit.train.trainer.Trainer` on every rank from one
:class:`~mlmkit.train.TrainConfig`, then lets the notebook advance training at three grains:

- :meth:`Session.step_action`: every pipeline rank whose next action can complete without waiting
  takes it (all TP ranks and dp replicas of that stage together, since they run in lockstep); a
  receive whose message has not been sent yet waits for a later call. The driver knows which
  ranks can go from a :class:`~mlmkit.pipeline.ScheduleCursor`, so no engine ever blocks.
- :meth:`Session.step_microbatch`: actions until the oldest unfinished microbatch is done everywhere.
- :meth:`Session.step`: the rest of the step and the optimizer update; returns the metrics.

:meth:`Session.state` shows every rank's position, the activations it holds with their shapes
and its memory so far; :meth:`Session.traces` gathers the traces of every rank.

After a failure the session resets the step in progress on every rank (gradients dropped, the
optimizer never stepped, so the weights are those of the last finished step). If an engine had to
be replaced, every rank rebuilds its trainer from the config and, when the session has a
``checkpoint_dir``, reloads the newest checkpoint (else training restarts from step 0).
"""

from __future__ import annotations

from typing import Optional

from mlmkit.cluster.cluster import Cluster, RankError
from mlmkit.pipeline import ScheduleCursor, make_schedule

__all__ = ["Session"]


# ------------------------------------------------------------------------- engine-side functions
def _build(state, config_dict, checkpoint_dir):
    from mlmkit.train import TrainConfig
    from mlmkit.train.trainer import Trainer

    cfg = TrainConfig.from_dict(config_dict)
    state.trainer = Trainer(cfg, groups=state.groups)
    if checkpoint_dir:
        import os

        from mlmkit.train.checkpoint import load_checkpoint

        if os.path.exists(os.path.join(checkpoint_dir, "latest")):
            load_checkpoint(state.trainer, checkpoint_dir)
    return state.trainer.step


def _begin(state):
    state.trainer.begin_step()


def _action(state):
    a = state.trainer.executor.step_action()
    return None if a is None else str(a)


def _finish(state, save_dir):
    t = state.trainer
    while not t.executor.done:
        t.executor.step_action()
    row = t.finish_step()
    if save_dir:
        from mlmkit.train.checkpoint import save_checkpoint

        save_checkpoint(t, save_dir)
    return row


def _reset(state):
    t = state.trainer
    if t is not None:
        t.executor.index = len(t.executor.actions)
        t.executor._reset()
        t.optimizer.zero_grad()


def _state(state):
    t = state.trainer
    ex = t.executor
    st = ex.state()
    mem = t.memory
    c = state.groups.coords
    return {"rank": state.rank, "tp": c.tp, "dp": c.dp, "pp": c.pp, "step": t.step,
            "position": st.index, "actions": st.total, "next_action": st.next_action,
            "held": st.held, "held_count": len(st.held),
            "activation_bytes": mem.activations if mem else None,
            "parameter_bytes": mem.parameter_bytes() if mem else None,
            "gradient_bytes": mem.gradient_bytes() if mem else None,
            "optimizer_bytes": mem.optimizer_bytes() if mem else None,
            "loss": st.loss}


def _traces(state, clear):
    out = state.trainer.traces()
    if clear:
        state.trainer.clear_traces()
    return out


# ------------------------------------------------------------------------------------ the session
class Session:
    """Step-by-step training on a running :class:`~mlmkit.cluster.Cluster` (see module docstring)."""

    def __init__(self, cluster: Cluster, config, *, checkpoint_dir: Optional[str] = None, save_every_step: bool = False):
        if config.topology != cluster.topology:
            raise ValueError(f"the config asks for {config.topology!r} but the cluster runs {cluster.topology!r}")
        self.cluster, self.config = cluster, config
        self.checkpoint_dir, self.save_every_step = checkpoint_dir, save_every_step
        self.schedule = make_schedule(config.schedule, stages=config.pp, microbatches=config.microbatches,
                                      chunks=config.chunks, layers=config.model.layers)
        self.cursor: Optional[ScheduleCursor] = None
        self.history: list[dict] = []
        self.last_actions: dict[int, Optional[str]] = {}
        self._build()

    def _build(self) -> None:
        self._generation = self.cluster.generation
        steps = self.cluster.run(_build, self.config.to_dict(), self.checkpoint_dir)
        self._generation = self.cluster.generation
        self.step_index = steps[0]
        self.cursor = None

    def _guarded(self, fn, *args, **kwargs):
        self.cluster.ensure_healthy()
        if self.cluster.generation != self._generation:
            self._build()            # an engine was replaced: it has no trainer, rebuild everywhere
            if fn is _action:        # the step in progress is gone with it
                raise RuntimeError("an engine was replaced since the last call; the step restarts: call again")
        try:
            return self.cluster.run(fn, *args, **kwargs)
        except RankError:
            self.cursor = None
            if self.cluster.generation != self._generation:
                self._build()
            else:
                self.cluster.run(_reset)
            raise

    def _ranks_of_stage(self, pp_rank: int) -> list[int]:
        topo = self.cluster.topology
        return [r for r in range(topo.world_size) if topo.coords(r).pp == pp_rank]

    # ------------------------------------------------------------------------- stepping
    def _ensure_begun(self) -> None:
        if self.cursor is None:
            self._guarded(_begin)
            self.cursor = ScheduleCursor(self.schedule)

    def step_action(self) -> dict:
        """Every pipeline rank that can go takes its next action.

        Returns ``{rank: action taken}`` (``None`` for ranks that waited); :meth:`state` shows more.
        """
        self._ensure_begun()
        ready = self.cursor.runnable()
        if not ready:
            return {r: None for r in range(self.cluster.world_size)}
        ranks = [r for p in ready for r in self._ranks_of_stage(p)]
        done = self._guarded(_action, ranks=ranks)
        self.last_actions = {r: done.get(r) for r in range(self.cluster.world_size)}
        for p in ready:
            self.cursor.advance(p)
        return dict(self.last_actions)

    @property
    def step_done(self) -> bool:
        """Every action of the current step has run (the optimizer update is still to come)."""
        return self.cursor is not None and self.cursor.done

    def step_microbatch(self):
        """Actions until the oldest unfinished microbatch has no action left on any rank."""
        self._ensure_begun()
        left = [a.microbatch for r in range(self.schedule.stages)
                for a in self.schedule.actions[r][self.cursor.index[r]:]]
        if not left:
            return self.state()
        target = min(left)
        while any(a.microbatch == target for r in range(self.schedule.stages)
                  for a in self.schedule.actions[r][self.cursor.index[r]:]):
            self.step_action()
        return self.state()

    def step(self) -> dict:
        """Finish the current step (or run a whole one) and update the weights. Returns its metrics."""
        self._ensure_begun()
        save = self.checkpoint_dir if self.save_every_step else None
        rows = self._guarded(_finish, save)
        self.cursor = None
        row = rows[0]
        self.history.append(row)
        return row

    def train(self, steps: int, *, progress: bool = True):
        """``steps`` whole steps; returns the metrics DataFrame (tqdm progress bar in notebooks)."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc="train", unit="step")
        for _ in range(steps):
            row = self.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
        if bar is not None:
            bar.close()
        return self.metrics()

    def reset_step(self) -> None:
        """Abandon the step in progress on every rank (no weight update)."""
        self.cluster.run(_reset)
        self.cursor = None

    # ------------------------------------------------------------------------- reading
    def state(self):
        """One row per rank: step, position in the schedule, next action, held activations, bytes."""
        import pandas as pd

        rows = self.cluster.run(_state)
        df = pd.DataFrame([rows[r] for r in sorted(rows)]).set_index("rank")
        if self.last_actions:
            df.insert(5, "last_action", [self.last_actions.get(r) for r in df.index])
        if self.cursor is not None:
            df["can_step"] = [self.cursor.can_step(df.loc[r, "pp"]) for r in df.index]
        return df

    def metrics(self):
        import pandas as pd

        return pd.DataFrame(self.history, columns=["step", "loss", "lr", "grad_norm", "step_time", "tokens_per_s"])

    def traces(self, *, clear: bool = False) -> dict:
        """Every rank's traces merged: ``events``, ``comm``, ``memory`` DataFrames and ``t0``."""
        from mlmkit.trace.export import merge_traces

        per_rank = self.cluster.run(_traces, clear)
        return merge_traces(per_rank[r] for r in sorted(per_rank))

    def __repr__(self) -> str:
        pos = repr(self.cursor) if self.cursor else "between steps"
        return f"Session({self.config.topology!r}, schedule={self.config.schedule}, steps done={len(self.history)}, {pos})"
