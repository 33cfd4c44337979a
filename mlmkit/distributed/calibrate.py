"""Measure this machine as a :class:`mlmkit.plan.Hardware` (``local-cpu``): what the planner needs to
predict mlmkit's own runs on CPU ranks.

:func:`calibrate_local_cpu` starts ``ranks`` processes (gloo, one thread each, as the trainer and
the cluster run them; or uses a cluster's engines) and measures, in about 30 s (``quick``: 5 s):

- **matmul throughput** of one process alone, fp32, ``[128, w] @ [w, 4w]`` for several widths
  ``w``: the best is the peak, and the width at which half of it is reached sets ``half_width``
  (the same efficiency curve as the GPU presets);
- **host time of a recomputed region** (random-state rewinds, torch's checkpoint) beyond the
  operators it adds;
- **time per dispatched operator**: a chain of small Transformer-like operators (linear, GELU,
  layer norm, residual add) forward and backward on tensors too small for their arithmetic to
  matter, divided by the number of aten operators it dispatches (counted with a dispatch mode).
  At the quickstart's size (hidden 64) this, not arithmetic, is most of a step;
- **collective latency per group size and gap**: every group of ``n`` ranks (``n`` dividing
  ``ranks``) all-reduces 16 floats at the same time, as tensor- or data-parallel groups do in a
  step, each time after a short and a long gap of work (2 and 32 repeats of the chain above),
  averaged over a long window: the time per call
  beyond that work run on all ranks at once without collectives. With more ranks than cores the
  operating system's scheduling is most of it, and it grows with the gap (a member that worked
  may have lost its core and waits for a time slice): 4 ranks on 2 cores, milliseconds, not
  microseconds;
- **all-gather and reduce-scatter** (ZeRO, sequence parallelism) over all ranks, after the same
  gaps: their latency as a fraction of the all-reduce's (``collective_factor``; a ring's theory
  says half, gloo here takes 0.75-1.2);
- **bandwidth**: a 4 MiB all-reduce over all ranks, its latency taken off;
- **message latency per pipeline depth**: groups of ``p`` ranks run a synthetic 1F1B step (chain
  work as forwards and backwards, 16-float messages); the latency at which
  :func:`mlmkit.pipeline.simulate` with the shared cores reproduces it (bisection);
- the number of **cores** the ranks share, the **memory** per rank (the machine's, divided), and
  a rank's resident set before any model (Python, torch, gloo: the framework allowance).

Collective over nothing: it launches its own processes (:func:`mlmkit.distributed.launch.run_ranks`),
so call it from a driver, not from inside ranks.
"""

from __future__ import annotations

import numbers
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from mlmkit.distributed.comm_group import _all_gather_single, _reduce_scatter_single
from mlmkit.distributed.launch import run_ranks

__all__ = ["calibrate_local_cpu", "count_ops"]

WIDTHS = (8, 16, 32, 64, 128, 256)


def count_ops(fn) -> int:
    """Number of aten operators ``fn()`` dispatches (forward and backward alike)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def _median_time(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _alone(rank: int, fn):
    """Run ``fn`` on rank 0 while the others wait in a barrier; broadcast its result."""
    dist.barrier()
    value = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        value[0] = fn()
    dist.broadcast(value, 0)
    return float(value[0])


def _matmul_gflops(width: int, seconds: float) -> float:
    a, b = torch.randn(128, width), torch.randn(width, 4 * width)
    flops = 2 * 128 * width * 4 * width
    reps = max(1, int(seconds * 40e9 / flops))        # about `seconds` at 40 GFLOP/s
    return flops / _median_time(lambda: [a @ b for _ in range(reps)], 5) * reps / 1e9


def _block():
    """One small Transformer-like step (layer norm, linear, GELU, residual add) and its input, on
    tensors too small for their arithmetic to matter: ``(body, x0)``."""
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    x0 = torch.randn(16, 8, requires_grad=True)

    def body(x):
        return x + torch.nn.functional.gelu(lin(norm(x)))

    return body, x0


def _chain(repeats: int):
    """``repeats`` of :func:`_block`'s step and the backward of them all."""
    body, x0 = _block()

    def run():
        x = x0
        for _ in range(repeats):
            x = body(x)
        x.sum().backward()

    return run


def _op_seconds() -> float:
    chain = _chain(4)
    return _median_time(chain, 200) / count_ops(chain)


def _recompute_seconds(op_s: float) -> float:
    """Host time of one recomputed region (:func:`mlmkit.model.blocks.recomputed`: random-state
    rewinds and torch's checkpoint machinery) beyond the operators it adds, which ``op_s`` prices."""
    from mlmkit.model.blocks import recomputed
    from mlmkit.tensor_parallel.random import TPRandomState

    body, x0 = _block()
    rng = TPRandomState(seed=0)

    def plain():
        body(x0).sum().backward()

    def kept():
        recomputed(body, rng, x0).sum().backward()

    extra_ops = count_ops(kept) - count_ops(plain)
    return max(0.0, _median_time(kept, 200) - _median_time(plain, 200) - extra_ops * op_s)


#: Repeats of the chain between two collectives (the work a rank does before it synchronises),
#: and how many such rounds each measurement averages: a long window, because on shared cores
#: single calls scatter over the scheduler's time slices.
GAPS = {2: 240, 32: 60}


def _window(fn, iterations: int) -> float:
    """Mean seconds per call of ``fn`` over ``iterations`` calls (after two unmeasured)."""
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations


def _rank(rank: int, world_size: int, quick: bool) -> dict:
    import psutil

    scale = 0.4 if quick else 1.0
    out: dict = {"rss": psutil.Process().memory_info().rss}
    # compute, one process alone (the others wait in a barrier and use no core)
    out["gflops"] = {w: _alone(rank, lambda w=w: _matmul_gflops(w, 0.01 if quick else 0.03)) for w in WIDTHS}
    out["op_s"] = _alone(rank, _op_seconds)
    out["recompute_s"] = _alone(rank, lambda: _recompute_seconds(out["op_s"]))
    works = {k: _chain(k) for k in sorted({*GAPS, PIPE_WORK, 2 * PIPE_WORK})}
    out["gap_s"] = {k: _alone(rank, lambda w=w: _median_time(w, 20)) for k, w in works.items()}
    small, gathered = torch.ones(16), torch.ones(16 * world_size)
    # collectives of every group size, all groups at once, each after a gap of work: the time per
    # round beyond the same work run on every rank at once without collectives (cores shared)
    latency, other = {}, {"all_gather": {}, "reduce_scatter": {}}
    for n in [k for k in range(2, world_size + 1) if world_size % k == 0]:
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world_size, n)]
        mine = groups[rank // n]
        for k, iterations in GAPS.items():
            w, its = works[k], max(10, int(iterations * scale))
            dist.barrier()
            shared = _window(w, its)
            dist.barrier()
            both = _window(lambda: (w(), dist.all_reduce(small, group=mine)), its)
            latency[(n, k)] = max(0.0, both - shared)
            if n == world_size:
                # all-gather and reduce-scatter (ZeRO, sequence parallelism) against that all-reduce
                calls = {"all_gather": lambda: _all_gather_single(gathered, small),
                         "reduce_scatter": lambda: _reduce_scatter_single(small, gathered)}
                for op, call in calls.items():
                    dist.barrier()
                    other[op][k] = max(0.0, _window(lambda: (w(), call()), its) - shared)
    out["latency"] = latency
    ar = sum(latency[(world_size, k)] for k in GAPS)
    out["collective_factor"] = {op: sum(t.values()) / ar for op, t in other.items()} if ar > 0 else {}
    big = torch.ones(2**20)           # 4 MiB
    dist.barrier()
    t_big = _median_time(lambda: dist.all_reduce(big), 3 if quick else 7)
    t_small = _window(lambda: dist.all_reduce(small), 50)
    out["bandwidth"] = big.numel() * 4 * 2 * (world_size - 1) / world_size / max(1e-9, t_big - t_small)
    # point-to-point: pipelines of every size p at once, a synthetic 1F1B step each
    out["pipeline"] = {p: _pipeline_step(rank, p, works[PIPE_WORK], works[2 * PIPE_WORK], 6 if quick else 12)
                       for p in range(2, world_size + 1) if world_size % p == 0}
    return out


#: The synthetic pipeline: groups of p ranks run 1F1B over this many microbatches, a forward being
#: PIPE_WORK repeats of the chain and a backward twice that.
PIPE_MICROBATCHES, PIPE_WORK = 8, 4


def _pipeline_step(rank: int, stages: int, forward, backward, reps: int) -> float:
    """Time of a 1F1B step of ``stages`` stages (consecutive ranks; every group at once) whose
    actions are chain work and whose messages are 16 floats: the median over ``reps`` steps."""
    from mlmkit.pipeline.schedule import make_schedule

    stage, base = rank % stages, rank - rank % stages
    actions = make_schedule("1f1b", stages=stages, microbatches=PIPE_MICROBATCHES).actions[stage]
    msg = torch.ones(16)

    def step():
        pending = []
        for a in actions:
            if a.kind == "F":
                forward()
            elif a.kind == "B":
                backward()
            elif a.kind.startswith("SEND"):
                pending.append(dist.isend(msg, base + a.peer))
            elif a.kind.startswith("RECV"):
                dist.recv(torch.empty(16), base + a.peer)
        for work in pending:
            work.wait()

    dist.barrier()
    return _window(step, reps)


def _effective_message_latency(measured: float, forward: float, backward: float, *, stages: int, cores: float,
                               world_size: int) -> float:
    """The message latency at which :func:`mlmkit.pipeline.simulate` reproduces the synthetic
    pipeline's ``measured`` step (``world_size / stages`` pipelines share ``cores``): bisection."""
    from mlmkit.pipeline.schedule import make_schedule
    from mlmkit.pipeline.simulate import Costs, simulate

    schedule = make_schedule("1f1b", stages=stages, microbatches=PIPE_MICROBATCHES)
    share = cores / (world_size // stages)

    def sim(latency):
        return simulate(schedule, Costs(forward=forward, backward=backward, p2p_latency=latency), cores=share).step_time

    lo, hi = 0.0, max(measured, 1e-6)
    if sim(lo) >= measured:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sim(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _repeat(rank: int, world_size: int, quick: bool, repeats: int) -> list[dict]:
    return [_rank(rank, world_size, quick) for _ in range(repeats)]


def _on_engine(state, quick: bool, repeats: int) -> list[dict]:
    return _repeat(state.rank, dist.get_world_size(), quick, repeats)


def calibrate_local_cpu(ranks: int = 4, *, quick: bool = False, repeats: Optional[int] = None,
                        timeout_s: float = 300.0, cluster=None):
    """Measure this machine for ``ranks`` CPU ranks (module docstring); returns a
    :class:`mlmkit.plan.Hardware` named ``local-cpu`` (fp32, mlmkit's runtime: collectives not
    overlapped with compute). Every quantity is the median of ``repeats`` measurements (default 3,
    about 30 s for 4 ranks on 2 cores; ``quick``: shorter windows and 1 repeat, ~5 s, for tests and
    notebooks), each averaged over the ranks where every rank measures.

    Calibrate where the runs will be: by default in fresh processes, as ``torchrun`` or
    :func:`~mlmkit.distributed.run_ranks` start them; with ``cluster=`` (a running
    :class:`mlmkit.cluster.Cluster`) on its engines, whose own threads (ipyparallel's heartbeat and
    messaging) also want the cores."""
    import psutil

    from mlmkit.plan.hardware import local_cpu

    if cluster is not None:
        ranks = cluster.world_size
    if isinstance(ranks, bool) or not isinstance(ranks, numbers.Integral) or ranks < 2:
        raise ValueError(f"calibrate_local_cpu: ranks={ranks!r} must be an integer >= 2 (collectives need peers)")
    if cluster is None:
        from mlmkit.distributed.launch import max_local_ranks

        limit = max_local_ranks()
        if ranks > limit:
            raise ValueError(f"calibrate_local_cpu: ranks={ranks} is more than this machine can run (at most "
                             f"{limit} CPU ranks in its available memory); calibrate for fewer ranks")
    repeats = repeats or (1 if quick else 3)
    if cluster is not None:
        results = cluster.run(_on_engine, quick, repeats, timeout_s=timeout_s)
        per_rank = [results[r] for r in range(ranks)]
    else:
        per_rank = run_ranks(_repeat, world_size=ranks, args=(quick, repeats), timeout_s=timeout_s)
    med = statistics.median
    runs = [[per_rank[r][i] for r in range(ranks)] for i in range(repeats)]      # runs[i][rank]
    r0s = [run[0] for run in runs]
    gap = {k: med(r["gap_s"][k] for r in r0s) for k in r0s[0]["gap_s"]}
    latency = {(n, gap[k]): med(statistics.mean(r["latency"][(n, k)] for r in run) for run in runs)
               for n, k in r0s[0]["latency"]}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    alone = (gap[PIPE_WORK], gap[2 * PIPE_WORK])
    p2p = {p: _effective_message_latency(med(statistics.mean(r["pipeline"][p] for r in run) for run in runs), *alone,
                                         stages=p, cores=cores, world_size=ranks) for p in r0s[0]["pipeline"]}
    return local_cpu(gflops_by_width={w: med(r["gflops"][w] for r in r0s) for w in WIDTHS},
                     op_overhead_s=med(r["op_s"] for r in r0s), recompute_overhead_s=med(r["recompute_s"] for r in r0s),
                     collective_latency=latency, bandwidth=med(r["bandwidth"] for r in r0s), p2p_latency=p2p,
                     cores=cores, memory_bytes=psutil.virtual_memory().total / ranks,
                     framework_bytes=max(r["rss"] for r in r0s), ranks=ranks,
                     collective_factor={op: med(statistics.mean(r["collective_factor"][op] for r in run) for run in runs)
                                        for op in r0s[0]["collective_factor"]})
