"""Tracing on against off: the same Trainer on 2 ranks (tp=2), steps alternated with the tracer and
the memory tracker enabled or disabled."""

from __future__ import annotations

import time

import torch.distributed as dist

from benchmarks.common import Row, alternate, paired
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig


def _rank(rank, world_size, reps):
    from mlmkit.train.trainer import Trainer

    model = GPTConfig(vocab_size=256, seq_len=128, hidden=256, heads=8, layers=4)
    cfg = TrainConfig(model=model, tp=world_size, micro_batch_size=4, global_batch_size=16, max_steps=10_000)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    memory = trainer.memory

    def step(traced: bool) -> float:
        trainer.tracer.enabled = traced
        trainer.executor.memory = memory if traced else None
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        trainer.clear_traces()
        return time.perf_counter() - t0

    return alternate(lambda: step(True), lambda: step(False), reps)


def run(quick: bool = False) -> list[Row]:
    reps = 10 if quick else 30
    res = run_ranks(_rank, world_size=2, args=(reps,), timeout_s=900)
    on = [max(a, b) for a, b in zip(res[0][0], res[1][0])]
    off = [max(a, b) for a, b in zip(res[0][1], res[1][1])]
    o, b, ratio = paired(on, off)
    return [Row("tracing on vs off", "Trainer step, tp=2, h=256, 4 layers, 4 microbatches",
                o * 1e3, b * 1e3, "ms", "<= 1.03", ratio <= 1.03, ratio=ratio)]
