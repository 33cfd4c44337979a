"""Pipeline schedules: mlmkit's executor against torch.distributed.pipelining, and the simulator
against the measurement after calibration.

For each (schedule, pp): the same GPT stages (same weights), the same microbatches, on CPU/gloo, one
process per stage. Each repetition runs one mlmkit step and one torch step, alternating which goes
first; step time = the slowest rank's. Then the simulator is calibrated with the per-rank median
forward and backward times measured by mlmkit's trace and a measured point-to-point latency, and
its step time is compared with the measured one. (With more ranks than cores, ranks contend for
the CPU, which the simulator does not model; the mean action times carry that contention.)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Row, alternate, median, paired
from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import tiny_config
from mlmkit.pipeline import Costs, make_schedule, simulate
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks
from mlmkit.trace import Tracer

CFG = tiny_config(layers=8, hidden=128, heads=4, seq_len=64, vocab_size=256)
MB = 4


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


def _rank(rank, world_size, name, m, reps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(Topology(pp=world_size), tracer=tracer)
    schedule = make_schedule(name, stages=world_size, microbatches=m)
    ours = PipelineExecutor(schedule=schedule, chunks=build_model_chunks(CFG, groups=groups), groups=groups)
    theirs_model = build_model_chunks(CFG, groups=groups)[0]
    stage = PipelineStage(theirs_model, rank, world_size, torch.device("cpu"))
    V = CFG.vocab_size

    def loss_fn(logits, target):  # logits [s, b, V], target [b, s]
        return F.cross_entropy(logits.float().reshape(-1, V), target.t().reshape(-1))

    theirs = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stage, n_microbatches=m, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (m * MB, CFG.seq_len), generator=g)
    targets = torch.randint(0, V, (m * MB, CFG.seq_len), generator=g)

    def step_ours():
        dist.barrier()
        t0 = time.perf_counter()
        ours.run_step(tokens, targets)
        return time.perf_counter() - t0

    def step_theirs():
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            theirs.step(tokens)
        elif rank == world_size - 1:
            theirs.step(target=targets, losses=[])
        else:
            theirs.step()
        return time.perf_counter() - t0

    for _ in range(2):
        step_ours(), step_theirs()
    tracer.clear()
    t_ours, t_theirs = alternate(step_ours, step_theirs, reps, warmup=0)
    ev = tracer.event_frame()
    # Mean, not median: with more ranks than cores, actions that overlap another rank's compute are
    # slower, and the mean carries that contention into the calibration.
    fwd = float(ev[ev.action == "F"].eval("end - start").mean())
    bwd = float(ev[ev.action == "B"].eval("end - start").mean())
    latency = _p2p_latency(groups, (CFG.seq_len, MB, CFG.hidden))
    return t_ours, t_theirs, fwd, bwd, latency


def run(quick: bool = False) -> list[Row]:
    reps = 6 if quick else 15
    rows = []
    for pp in (2, 4):
        m = 2 * pp
        for name in ("gpipe", "1f1b"):
            res = run_ranks(_rank, world_size=pp, args=(name, m, reps), timeout_s=600)
            ours, theirs, ratio = paired([max(r[0][i] for r in res) for i in range(reps)],
                                         [max(r[1][i] for r in res) for i in range(reps)])
            rows.append(Row("pipeline step vs torch.distributed.pipelining", f"{name}, pp={pp}, m={m}",
                            ours * 1e3, theirs * 1e3, "ms", "<= 1.0", ratio <= 1.0, ratio=ratio))
            costs = Costs(forward=[r[2] for r in res], backward=[r[3] for r in res], p2p_latency=res[0][4])
            sim = simulate(make_schedule(name, stages=pp, microbatches=m), costs).step_time
            err = abs(sim - ours) / ours
            rows.append(Row("simulated vs measured step (calibrated)", f"{name}, pp={pp}, m={m}",
                            sim * 1e3, ours * 1e3, "ms", "within 15%", err <= 0.15,
                            note=f"error {err:.1%}"))
    return rows
