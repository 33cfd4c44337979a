"""Pipeline schedules: mlmkit's executor against torch.distributed.pipelining, zero bubble against
1F1B, and the simulator against the measurement after calibration.

For each case: the same GPT stages (same weights), the same microbatches, on CPU/gloo, one process
per pipeline rank. Each repetition runs one step of each side, alternating which goes first; step
time = the slowest rank's. Pairs:

- gpipe, 1f1b: mlmkit against torch's ScheduleGPipe / Schedule1F1B;
- interleaved-1f1b against torch's ScheduleInterleaved1F1B; torch's ScheduleInterleavedZeroBubble
  order run by mlmkit (``from_torch``) against torch's runtime running it; zb-v against torch's
  ScheduleZBVZeroBubble (2 chunks per rank);
- zb-h1 against mlmkit's own 1f1b (a zero-bubble schedule must beat the plain one).

Calibration: every action timed alone, rank after rank (:func:`mlmkit.pipeline.calibrate.measure_costs`:
F, and the split backward's I and W, or the full B); the per-action CPU overhead of a real step
(:func:`~mlmkit.pipeline.calibrate.measure_overhead`: CPU time beyond the actions' solo costs, not
wall time); a measured point-to-point latency; and the machine's core count (``simulate(...,
cores=)``: 4 ranks on 2 cores share them). The simulated step is compared with the measured one for
every mlmkit row.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Row, alternate, median, paired
from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import tiny_config
from mlmkit.pipeline import from_torch, make_schedule, simulate
from mlmkit.pipeline.calibrate import measure_costs, measure_overhead
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks

CFG = tiny_config(layers=8, hidden=128, heads=4, seq_len=64, vocab_size=256)
MB = 4
TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
               "torch:interleaved-zb": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble"}


def _p2p_latency(groups, shape, reps=20):
    # Half a round trip between stage 0 and stage 1 with an activation-sized message.
    if groups.topology.pp < 2 or groups.coords.pp > 1:
        dist.barrier()
        return 0.0
    buf = torch.zeros(shape)
    peer = groups.pp.ranks[1 - groups.coords.pp]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if groups.coords.pp == 0:
            dist.send(buf, peer, group=groups.pp.pg)
            dist.recv(buf, peer, group=groups.pp.pg)
        else:
            dist.recv(buf, peer, group=groups.pp.pg)
            dist.send(buf, peer, group=groups.pp.pg)
        times.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return median(times)


def _torch_side(groups, name, m, chunks):
    """torch's schedule object for ``name`` on these ranks (and its model chunks)."""
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage

    p, r = groups.topology.pp, groups.coords.pp
    placement = "v" if name == "zb-v" else "loop"
    models = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=placement)
    stages = [PipelineStage(mod, mod.stage.index, p * chunks, torch.device("cpu"), group=groups.pp.pg)
              for mod in models]
    V = CFG.vocab_size

    def loss_fn(logits, target):  # logits [s, b, V], target [b, s]
        return F.cross_entropy(logits.float().reshape(-1, V), target.t().reshape(-1))

    cls = getattr(S, TORCH_CLASS[name])
    sched = cls(stages[0] if chunks == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    return sched, models


def _rank(rank, world_size, name, m, reps, versus):
    """Time mlmkit's step for ``name`` against ``versus`` ("torch": torch's runtime on the same
    schedule; or another mlmkit schedule name); calibrate the simulator."""
    groups = ProcessGroups.build(Topology(pp=world_size))
    chunks = 2 if name in ("interleaved-1f1b", "zb-v", "torch:interleaved-zb") else 1
    theirs_sched, theirs_models = (None, None)
    if versus == "torch":
        theirs_sched, theirs_models = _torch_side(groups, name, m, chunks)
    if name == "torch:interleaved-zb":     # torch's order, run by mlmkit's executor
        schedule = from_torch(theirs_sched, name=name)
    else:
        schedule = make_schedule(name, stages=world_size, microbatches=m, chunks=chunks)
    ours_models = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=schedule.placement,
                                     split_backward=schedule.split_backward)
    ours = PipelineExecutor(schedule=schedule, chunks=ours_models, groups=groups)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (m * MB, CFG.seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (m * MB, CFG.seq_len), generator=g)

    def step_ours():
        dist.barrier()
        t0 = time.perf_counter()
        ours.run_step(tokens, targets)
        for model in ours_models:
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    if versus == "torch":
        first = any(mod.stage.pre_process for mod in theirs_models)
        last = any(mod.stage.post_process for mod in theirs_models)

        def step_theirs():
            dist.barrier()
            t0 = time.perf_counter()
            kwargs = dict(target=targets, losses=[]) if last else {}
            theirs_sched.step(*((tokens,) if first else ()), **kwargs)
            for model in theirs_models:
                model.zero_grad(set_to_none=True)
            return time.perf_counter() - t0
    else:
        base = make_schedule(versus, stages=world_size, microbatches=m)
        base_models = build_model_chunks(CFG, groups=groups)
        base_ex = PipelineExecutor(schedule=base, chunks=base_models, groups=groups)

        def step_theirs():
            dist.barrier()
            t0 = time.perf_counter()
            base_ex.run_step(tokens, targets)
            for model in base_models:
                model.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

    for _ in range(2):
        step_ours(), step_theirs()
    t_ours, t_theirs = alternate(step_ours, step_theirs, reps, warmup=0)
    costs = measure_costs(schedule, ours_models, groups, tokens[:MB], targets[:MB])
    costs = measure_overhead(ours, costs, tokens, targets)
    latency = _p2p_latency(groups, (CFG.seq_len, MB, CFG.hidden))
    return t_ours, t_theirs, costs, latency, schedule


CASES = [("gpipe", "torch"), ("1f1b", "torch"), ("zb-h1", "1f1b"), ("interleaved-1f1b", "torch"),
         ("torch:interleaved-zb", "torch"), ("zb-v", "torch")]


def run(quick: bool = False) -> list[Row]:
    reps = 6 if quick else 15
    cores = os.cpu_count() or 1
    rows = []
    for pp in (2, 4):
        m = 2 * pp
        simulated = {}
        for name, versus in CASES:
            res = run_ranks(_rank, world_size=pp, args=(name, m, reps, versus), timeout_s=900)
            ours, theirs, ratio = paired([max(r[0][i] for r in res) for i in range(reps)],
                                         [max(r[1][i] for r in res) for i in range(reps)])
            what = "pipeline step vs torch.distributed.pipelining" if versus == "torch" else f"{name} step vs {versus}"
            against = TORCH_CLASS.get(name, "") if versus == "torch" else f"mlmkit {versus}"
            rows.append(Row(what, f"{name}, pp={pp}, m={m} (vs {against})", ours * 1e3, theirs * 1e3, "ms",
                            "<= 1.0", ratio <= 1.0, ratio=ratio))
            costs, latency, schedule = res[0][2], res[0][3], res[0][4]
            from dataclasses import replace
            calibrated = replace(costs, p2p_latency=latency)
            sim = simulate(schedule, calibrated, cores=cores).step_time
            err = abs(sim - ours) / ours
            rows.append(Row("simulated vs measured step (calibrated)", f"{name}, pp={pp}, m={m}, {cores} cores",
                            sim * 1e3, ours * 1e3, "ms", "within 15%", err <= 0.15, note=f"error {err:.1%}"))
            simulated[name] = (schedule, calibrated)
        # With fewer cores than ranks a bubble is not idle time (another rank computes), so there is
        # little for zero bubble to recover: what it does with one core per rank, from the same calibration.
        (zb, zb_costs), (ofob, ofob_costs) = simulated["zb-h1"], simulated["1f1b"]
        zb_t, ofob_t = simulate(zb, zb_costs).step_time, simulate(ofob, ofob_costs).step_time
        rows.append(Row("zb-h1 step vs 1f1b, simulated", f"pp={pp}, m={m}, one core per rank (calibrated above)",
                        zb_t * 1e3, ofob_t * 1e3, "ms", "<= 1.0", zb_t <= ofob_t))
    return rows
