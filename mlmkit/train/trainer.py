"""The Trainer: one rank's model chunks, pipeline executor, optimizer and data, step by step.

The same object runs in a notebook engine (driven action by action by :mod:`mlmkit.cluster`), in
the tests (through :func:`mlmkit.distributed.run_ranks`) and under ``torchrun -m mlmkit.train``.

One step (:meth:`Trainer.train_step`):

1. take this dp replica's slice of the global batch for the current step;
2. run the pipeline schedule (forward and backward of every microbatch; gradients accumulate; the
   executor finishes with the sequence-parallel and tied-embedding gradient sums);
3. optimizer step: dp gradient average (bucketed all-reduce, or reduce-scatter with ZeRO-1),
   global norm clipping, AdamW at the scheduled learning rate;
4. metrics: the loss averaged over microbatches and replicas, gradient norm, step time, tokens/s.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from mlmkit.data_parallel import Zero3Hooks, attach_main_grads, dtype_of, make_optimizer, shard_units
from mlmkit.distributed import ProcessGroups
from mlmkit.model.gpt import moe_layers
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks
from mlmkit.train.config import TrainConfig
from mlmkit.train.data import TextData
from mlmkit.train.lr import lr_at
from mlmkit.trace import Tracer
from mlmkit.trace.memory import MemoryTracker

__all__ = ["Trainer", "traced_step"]


class Trainer:
    """Training on one rank. Collective: every rank of the job builds one and steps it together.

    Args:
        config: the run (validated).
        groups: this rank's process groups (their topology must equal ``config.topology``).
        tracer: records actions and collectives (default: a new one of its own, on if
            ``config.tracing``). Several trainers may share one set of process groups (sessions
            on the same engines): each keeps its own tracer, and a trainer routes the groups'
            collectives to its tracer whenever it begins a step (:meth:`claim_groups`).
    """

    def __init__(self, config: TrainConfig, *, groups: ProcessGroups, tracer=None):
        # The experts flag is checked where the expert groups are used (ProcessGroups.expert_groups):
        # a serial reference's single groups serve a model with experts too.
        if groups.topology != replace(config.topology, experts=groups.topology.experts):
            raise ValueError(f"process groups are built for {groups.topology!r} but the config asks for "
                             f"{config.topology!r}")
        self.config, self.groups = config, groups
        # Not the groups' tracer: another trainer on these groups (an earlier session with
        # tracing=False) would decide whether this one records, and its rows would mix with ours.
        self.tracer = tracer if tracer is not None else Tracer(rank=groups.rank, enabled=config.tracing)
        self.claim_groups()
        torch.manual_seed(config.seed)
        self.schedule = config.pipeline_schedule()     # a generator's, or a file's as read and checked
        self.chunks = build_model_chunks(config.model, groups=groups, chunks=config.chunks,
                                         sequence_parallel=config.sequence_parallel, recompute=config.recompute,
                                         dtype=dtype_of(config.precision), split_backward=self.schedule.split_backward,
                                         placement=self.schedule.placement, cp_split=config.cp_split)
        named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        if config.precision != "fp32":
            attach_main_grads(p for _, p in named)      # fp32 gradients, accumulated across microbatches
        self.optimizer = make_optimizer(
            named, groups, zero=config.zero, bucket_bytes=config.bucket_bytes,
            units=shard_units(self.chunks) if config.zero >= 2 else None,
            betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay,
            max_grad_norm=config.grad_clip, grad_reduce_dtype=dtype_of(config.grad_reduce))
        self.memory = (MemoryTracker(rank=groups.rank, params=[p for _, p in named], optimizer=self.optimizer)
                       if config.tracing else None)
        self.executor = PipelineExecutor(schedule=self.schedule, chunks=self.chunks, groups=groups,
                                         tracer=self.tracer, memory=self.memory, batch_p2p=config.batch_p2p,
                                         per_token_loss=config.per_token_loss)
        self.zero3: Optional[Zero3Hooks] = None
        if config.zero >= 2:      # reduce each layer's gradient after its last backward; ZeRO-3: gather
            #                       each layer when used, free it after (mlmkit.data_parallel.zero)
            self.zero3 = Zero3Hooks(self.optimizer, self.chunks, prefetch=config.prefetch,
                                    reshard_after_forward=config.reshard_after_forward,
                                    microbatches=config.microbatches, tp=groups.tp,
                                    reduce_in_backward=not self.schedule.split_backward).attach()
            self.zero3.memory = self.memory
            self.executor.on_backward_done = self.zero3.backward_done
        self.data = TextData(seq_len=config.model.seq_len, path=config.corpus, seed=config.seed)
        self.step = 0
        self.history: list[dict] = []
        self._t0: Optional[float] = None
        self.updating = False   # True while the optimizer changes weights (a failure then leaves them torn)
        #: True from :meth:`begin_step` until :meth:`finish_step` or :meth:`abandon_step`: the
        #: executor holds this step's activations and the random streams have moved on.
        self.in_step = False
        self._rng_at_begin = None   # the random streams at the start of the step in progress

    # ------------------------------------------------------------------ stepping
    def lr(self, step: Optional[int] = None) -> float:
        c = self.config
        return lr_at(self.step if step is None else step, lr=c.lr, min_lr=c.min_lr,
                     warmup_steps=c.warmup_steps, max_steps=c.max_steps)

    def claim_groups(self) -> None:
        """Route the collectives of this trainer's process groups to its tracer (they may serve
        several trainers, one stepping at a time)."""
        self.groups.set_tracer(self.tracer)

    def begin_step(self) -> None:
        """Load this step's batch into the executor; then call ``executor.step_action()`` repeatedly."""
        if self.in_step:
            ex = self.executor
            raise RuntimeError(
                f"begin_step: step {self.step} is already in progress on rank {self.groups.rank} ("
                + (f"action {ex.index} of {len(ex.actions)} done" if not ex.done else "its actions done")
                + "); beginning it again would silently drop it after its dropout masks were drawn. Finish it "
                  "(finish_step() once the executor is done) or drop it first (abandon_step())")
        self._refuse_torn("begin_step")
        c = self.config
        self.claim_groups()
        tokens, targets = self.data.batch(self.step, c.global_batch_size)      # the global batch
        # Per-token loss: every replica divides its summed token losses by the tokens of the whole
        # global batch (times dp x cp, since the dp-cp gradient reduction averages; each cp rank
        # sums the losses of its own tokens only).
        scale = c.dp * c.cp / max(1, int((targets != self.executor.ignore_index).sum()))
        n = c.global_batch_size // c.dp
        lo = self.groups.coords.dp * n
        for model in self.chunks:
            model.train()
        # The random streams as the step finds them: an abandoned step puts them back, so that the
        # step run again draws the dropout masks an uninterrupted run draws.
        self._rng_at_begin = ([model.rng.get_state() for model in self.chunks], torch.get_rng_state())
        self.optimizer.zero_grad()
        self.tracer.step = self.step           # this step's rows are told apart from the others'
        self.tracer.mark()                     # an abandoned step's rows are dropped
        if self.memory is not None:
            self.memory.step = self.step
            self.memory.mark()
        self._t0 = time.perf_counter()
        self.in_step = True
        self.executor.start_step(tokens[lo:lo + n], targets[lo:lo + n], loss_scale=scale)

    def _refuse_torn(self, what: str) -> None:
        if self.updating:
            raise RuntimeError(
                f"{what}: rank {self.groups.rank} failed while the optimizer was updating the weights of step "
                f"{self.step}, so they are torn (part old, part new); load the last checkpoint "
                f"(mlmkit.train.checkpoint.load_checkpoint) before training on")

    def abandon_step(self) -> None:
        """Drop the step in progress (activations, pending messages, gradients); weights unchanged
        unless the failure hit during the optimizer update (then :attr:`updating` stays True). The
        dropout streams go back to where the step found them."""
        self.executor.abandon()
        self.in_step = False
        self.tracer.rewind()                   # run again, the step records its rows anew
        if self.memory is not None:
            self.memory.rewind()
        self.optimizer.zero_grad()
        if self.zero3 is not None:
            self.zero3.reset()
        if self._rng_at_begin is not None and not self.updating:
            chunk_states, torch_state = self._rng_at_begin
            for model, state in zip(self.chunks, chunk_states):
                model.rng.set_state(state)
            torch.set_rng_state(torch_state)

    def finish_step(self) -> dict:
        """After the schedule ran: optimizer step and metrics (collective over the world)."""
        if not self.in_step:
            raise RuntimeError(f"finish_step: no step in progress on rank {self.groups.rank} (step {self.step} has not "
                               f"begun; the one before is finished): call begin_step() and the schedule's actions "
                               f"first, or train_step()")
        self._refuse_torn("finish_step")
        if not self.executor.done:
            raise RuntimeError(f"the schedule is not finished ({self.executor.state().next_action} is next)")
        self.executor.finalize(wait_sends=False)
        loss = self._mean_loss()
        self.executor.wait_sends()           # every rank reached the loss: every message was received
        lr = self.lr()
        self.updating = True
        grad_norm = self.optimizer.step(lr=lr)
        self.updating = False
        self.in_step = False
        self._rng_at_begin = None          # the step is done: nothing to put back
        self.tracer.unmark()
        if self.memory is not None:
            self.memory.unmark()
            self.memory.record(action="optimizer", microbatch=-1)
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        tokens = self.config.global_batch_size * self.config.model.seq_len
        row = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": elapsed,
               "tokens_per_s": tokens / elapsed if elapsed > 0 else float("nan")}
        if self.config.model.moe:
            row.update(self._moe_metrics())
        self.history.append(row)
        self.step += 1
        return row

    def train_step(self) -> dict:
        """One whole optimizer step; returns its metrics."""
        self.begin_step()
        while not self.executor.done:
            self.executor.step_action()
        return self.finish_step()

    def fit(self, steps: Optional[int] = None, *, progress: bool = True):
        """Train ``steps`` steps (default: up to ``config.max_steps``); returns the metrics DataFrame.

        A progress bar (tqdm.auto: a widget in notebooks, text elsewhere) is shown on global rank 0.
        """
        if steps is None:
            steps = self.config.max_steps - self.step
            if steps < 0:
                raise ValueError(f"Trainer.fit(): this trainer is at step {self.step}, past max_steps="
                                 f"{self.config.max_steps}: pass steps=N to train N more steps")
        elif isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"Trainer.fit(steps={steps!r}): steps must be a whole number >= 0")
        bar = None
        if progress and self.groups.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc="train", unit="step")
        for _ in range(steps):
            row = self.train_step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if bar is not None:
            bar.close()
        return self.metrics()

    def metrics(self):
        """Per-step metrics as a DataFrame (step, loss, lr, grad_norm, step_time, tokens_per_s)."""
        import pandas as pd

        columns = ["step", "loss", "lr", "grad_norm", "step_time", "tokens_per_s"]
        if self.config.model.moe:
            columns += ["aux_loss", "dropped"]
        return pd.DataFrame(self.history, columns=columns)

    def traces(self) -> dict:
        """This rank's traces as DataFrames: ``events`` (schedule actions), ``comm``, ``memory``,
        ``ring`` (ring-attention steps, with context parallelism), ``moe`` (routing per MoE layer
        call); and ``clock``: this host and its wall-minus-monotonic offset (for merging ranks of
        several hosts)."""
        import pandas as pd

        from mlmkit.trace.memory import MEMORY_COLUMNS

        return {"events": self.tracer.event_frame(), "comm": self.tracer.comm_frame(), "ring": self.tracer.ring_frame(),
                "moe": self.tracer.moe_frame(),
                "memory": self.memory.frame() if self.memory is not None else pd.DataFrame(columns=MEMORY_COLUMNS),
                "clock": _clock()}

    def clear_traces(self) -> None:
        self.tracer.clear()
        if self.memory is not None:
            self.memory.clear()

    def _mean_loss(self) -> float:
        # The last pipeline stage holds the loss (identical on its TP ranks; each cp rank holds the
        # part of its tokens, scaled by cp); average over replicas and cp ranks.
        mine = self.executor.loss
        value = mine if (mine is not None and self.groups.coords.tp == 0) else 0.0
        t = torch.tensor([value], dtype=torch.float64, device=self.groups.device)
        self.groups.world.all_reduce(t, site="loss")
        return float(t) / (self.config.dp * self.config.cp)

    def _moe_metrics(self) -> dict:
        # Per step: the auxiliary losses (load balancing + z, weighted) summed over layers, averaged over
        # microbatches and replicas; and the assignments dropped by capacity limits (all ranks).
        layers = [layer for c in self.chunks for layer in moe_layers(c)]
        aux = sum(sum(h["aux_loss"] + h["z_loss"] for h in layer.history) / max(1, len(layer.history))
                  for layer in layers)
        dropped = sum(h["dropped"] for layer in layers for h in layer.history)
        c = self.groups.coords
        mine = aux if (c.tp == 0 and c.cp == 0) else 0.0
        t = torch.tensor([mine, float(dropped)], dtype=torch.float64, device=self.groups.device)
        self.groups.world.all_reduce(t, site="moe_metrics")
        return {"aux_loss": float(t[0]) / self.config.dp, "dropped": int(t[1])}

    def named_parameters(self):
        for c in self.chunks:
            yield from c.named_parameters()

    @contextlib.contextmanager
    def full_parameters(self):
        """A context in which every parameter is whole (ZeRO-3 gathers them; collective over the
        replicas). Wrap reads and writes of the weights between steps: what the block writes into
        the parameters becomes the weights (the optimizer's fp32 masters and ZeRO shards take it at
        the end of the block; without that, the next update wrote the old weights back). Write the
        same values on every replica, and clone what you keep beyond the block (ZeRO-3 frees the
        parameters' memory when it ends)."""
        materialized = getattr(self.optimizer, "materialized", None)
        with materialized() if materialized is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                self.optimizer.params_written()

    def __repr__(self) -> str:
        c = self.config
        return (f"Trainer(rank={self.groups.rank}, {c.topology!r}, schedule={c.schedule}, step={self.step}, "
                f"zero={c.zero}, sp={c.sequence_parallel}, recompute={c.recompute}, precision={c.precision})")


def _clock() -> dict:
    """Which machine's monotonic clock the times are in, and how to move them onto the wall clock
    (for :func:`mlmkit.trace.export.merge_traces` of ranks on several hosts)."""
    import socket

    return {"host": socket.gethostname(), "wall_minus_monotonic": time.time() - time.perf_counter()}


def traced_step(rank: int, world_size: int, config_dict: dict, warmup_steps: int = 1) -> dict:
    """A :func:`mlmkit.distributed.run_ranks` target: build a Trainer from ``config_dict``, run
    ``warmup_steps`` steps (so optimizer state exists), trace one more step, return its traces."""
    cfg = TrainConfig.from_dict(config_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    for _ in range(warmup_steps):
        trainer.train_step()
    trainer.clear_traces()
    trainer.train_step()
    return trainer.traces()


def time_layouts(configs, *, steps: int = 6, warmup: int = 2, rounds: int = 2) -> list[float]:
    """Median step time (seconds) of each config's training, measured on this job's ranks.

    Collective: every rank of a world of ``configs[i].topology.world_size`` ranks calls it with the
    same configs. Builds one :class:`Trainer` per config (its own process groups), then ``rounds``
    times goes through the configs in turn: ``warmup`` steps, then ``steps`` timed steps, each
    between two barriers (so a step ends when its slowest rank ends). Interleaving the rounds
    spreads a noisy machine's slow spells over all configs. Returns the median per config.
    """
    import statistics

    trainers = []
    for config in configs:
        groups = ProcessGroups.build(config.topology)
        trainers.append(Trainer(config, groups=groups))
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(rounds):
        for trainer, bucket in zip(trainers, times):
            for _ in range(warmup):
                trainer.train_step()
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                trainer.train_step()
                dist.barrier()
                bucket.append(time.perf_counter() - t0)
    return [statistics.median(b) for b in times]
