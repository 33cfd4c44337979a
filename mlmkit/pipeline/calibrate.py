"""Measure what each schedule action costs on this machine, for the simulator.

:func:`measure_costs` times, on every rank, the forward (F), the full backward (B) and the split
backward's two halves (I: input gradient; W: weight-gradient GEMMs) of each of its model chunks on
one microbatch. Ranks take turns (a barrier between them), so each action is timed *alone*: that is
what :func:`mlmkit.pipeline.simulate` expects, and with ``cores=`` it then predicts how ranks that
share a few CPU cores slow each other down. Collective over the world (every rank calls it).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from mlmkit.distributed import ProcessGroups
from mlmkit.model import GPT
from mlmkit.pipeline.schedule import Schedule
from mlmkit.pipeline.simulate import Costs

__all__ = ["measure_costs", "measure_overhead"]


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _chunk_times(model: GPT, tokens: torch.Tensor, targets: torch.Tensor, reps: int) -> dict[str, float]:
    cfg = model.config
    s, b = tokens.shape[1], tokens.shape[0]
    if model.sequence_parallel:
        s //= model.tp.size
    dtype = next(model.parameters()).dtype
    out: dict[str, list] = {"F": [], "B": [], "I": [], "W": []}

    def forward():
        x = tokens if model.stage.pre_process else torch.randn(s, b, cfg.hidden, dtype=dtype, requires_grad=True)
        y = model(x, targets) if model.stage.post_process else model(x)
        g = None if model.stage.post_process else torch.randn_like(y)
        return y, g

    for _ in range(reps):
        holder = {}
        out["F"].append(_time(lambda: holder.update(zip(("y", "g"), forward()))))
        out["B"].append(_time(lambda: torch.autograd.backward(holder["y"], grad_tensors=holder["g"])))
        if model.wgrad is not None:
            y, g = forward()
            with model.wgrad.defer():
                out["I"].append(_time(lambda: torch.autograd.backward(y, grad_tensors=g)))
            work = model.wgrad.take()
            out["W"].append(_time(lambda: model.wgrad.run(work)))
        model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in out.items() if v}


def measure_costs(schedule: Schedule, chunks: Sequence[GPT], groups: ProcessGroups, tokens: torch.Tensor,
                  targets: torch.Tensor, *, reps: int = 5, warmup: int = 2) -> Costs:
    """:class:`Costs` per virtual stage from solo timings of one microbatch (``tokens``/``targets``
    ``[b_mb, s]``) on every rank; the same Costs on every rank. ``backward`` is I (or B when the
    chunks cannot split), ``weight`` is W (0 when they cannot)."""
    p = schedule.stages
    mine: dict[int, dict[str, float]] = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for turn in range(world):
        if turn == groups.rank:
            for model in chunks:
                _chunk_times(model, tokens, targets, warmup)            # warm caches and kernels
                mine[model.stage.index] = _chunk_times(model, tokens, targets, reps)
        if dist.is_initialized():
            dist.barrier()
    table = [None] * schedule.virtual_stages
    gathered = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    for per_rank in gathered:
        for vs, times in per_rank.items():
            if table[vs] is None:
                table[vs] = times
    forward = [t["F"] for t in table]
    # A split schedule pays I and W (B, when it also runs full backwards, is close to I + W); an
    # unsplit one pays the measured full backward.
    split = schedule.split_backward and all("I" in t for t in table)
    backward = [t["I"] if split else t["B"] for t in table]
    weight = [t["W"] if split else 0.0 for t in table]
    assert p == schedule.stages
    return Costs(forward=forward, backward=backward, weight=weight)


def measure_overhead(executor, costs: Costs, tokens: torch.Tensor, targets: torch.Tensor, *, reps: int = 3) -> Costs:
    """``costs`` with ``overhead``: the CPU time one real step of ``executor`` takes on a rank beyond
    its actions' solo costs (the executor's bookkeeping, message copies, gloo's threads), per
    compute action, averaged over ranks and ``reps`` steps. CPU time, not wall time: waiting for
    peers or for a core does not count. Collective over the world."""
    from dataclasses import replace

    schedule = executor.schedule
    rank = executor.pp_rank
    solo = sum(costs.duration(schedule, rank, a) for a in schedule.compute_actions(rank))
    n = len(schedule.compute_actions(rank))
    cpu = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        c0 = time.process_time()
        executor.run_step(tokens, targets)
        cpu.append(time.process_time() - c0)
        for model in executor.chunks:
            model.zero_grad(set_to_none=True)
    per_action = torch.tensor([max(0.0, (statistics.median(cpu) - solo) / n)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(per_action)
        per_action /= dist.get_world_size()
    return replace(costs, overhead=float(per_action))
