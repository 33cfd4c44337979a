"""Pipeline schedules: mlmkit's executor against torch.distributed.pipelining, zero bubble against
1F1B, and the simulator against the measurement after calibration.

For each case: the same GPT stages (same weights), the same microbatches, on CPU/gloo, one process
per pipeline rank. Each repetition runs one step of each side, alternating which goes first; step
time = the slowest rank's. Pairs:

- gpipe, 1f1b: mlmkit against torch's ScheduleGPipe / Schedule1F1B;
- interleaved-1f1b against torch's ScheduleInterleaved1F1B; torch's ScheduleInterleavedZeroBubble
  order run by mlmkit (``from_torch``) against torch's runtime running it; zb-v against torch's
  ScheduleZBVZeroBubble (2 chunks per rank), dualpipev against ScheduleDualPipeV (DeepSeek's DualPipe
  in its V form, 2 chunks per rank);
- zb-h1 against mlmkit's own 1f1b (a zero-bubble schedule must beat the plain one), on the model
  above and on the same stages three times wider (``WIDE``), where W is GEMM-bound.

Calibration: every action timed alone, rank after rank (:func:`mlmkit.pipeline.calibrate.measure_costs`:
F, and the split backward's I and W, or the full B); the per-action CPU overhead of a real step
(:func:`~mlmkit.pipeline.calibrate.measure_overhead`: CPU time beyond the actions' solo costs, not
wall time); a measured point-to-point latency; and the machine's core count (``simulate(...,
cores=)``: 4 ranks on 2 cores share them). The simulated step is compared with the measured one for
every mlmkit row. Each case runs three windows in a row, each its paired steps followed by a
calibration, then one more set of paired steps; each calibration is set against the median of the
steps right before and right after it, and the simulation's ratio is the median of the windows' (a
machine shared with other virtual machines changes speed from minute to minute; a calibration made
in a fast spell set against steps measured in a slow one erred by 25% in an earlier run, and with
the steps before it only, two of three runs on one day missed one row by 17%).

For zb-h1 against 1f1b the table also gives the CPU time of all ranks per step and the cores' idle
time (cores x step - CPU): what a zero-bubble schedule fills, and what its split backward costs;
and both simulated with one core per rank (where a bubble is idle time), each window's zb-h1 and
1f1b calibrated one right after the other on the same ranks.

The model's embeddings are untied: with tied ones mlmkit also all-reduces the word embedding's
gradient between the first and last stage each step (Megatron-LM's embedding group), which torch's
runtime leaves to its user.
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

# Untied embeddings: with tied ones mlmkit all-reduces the word embedding's gradient between the first
# and the last stage at the end of every step (Megatron-LM's embedding group), which torch's runtime
# leaves to its user; untied, both sides do exactly the same work.
CFG = tiny_config(layers=8, hidden=128, heads=4, seq_len=64, vocab_size=256, tie_embeddings=False)
# The same stages three times wider: each linear's GEMM costs 9x, the split backward's fixed costs
# per linear (a Python step, X and dY read back from memory) grow 3x, so W is GEMM-bound.
WIDE = tiny_config(layers=8, hidden=384, heads=4, seq_len=64, vocab_size=256, tie_embeddings=False)
MB = 4
TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
               "torch:interleaved-zb": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}


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


def _torch_side(groups, name, m, chunks, cfg):
    """torch's schedule object for ``name`` on these ranks (and its model chunks) of model ``cfg``."""
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage

    p, r = groups.topology.pp, groups.coords.pp
    placement = "v" if name in ("zb-v", "dualpipev") else "loop"
    models = build_model_chunks(cfg, groups=groups, chunks=chunks, placement=placement)
    stages = [PipelineStage(mod, mod.stage.index, p * chunks, torch.device("cpu"), group=groups.pp.pg)
              for mod in models]
    V = cfg.vocab_size

    def loss_fn(logits, target):  # logits [s, b, V], target [b, s]
        return F.cross_entropy(logits.float().reshape(-1, V), target.t().reshape(-1))

    cls = getattr(S, TORCH_CLASS[name])
    sched = cls(stages[0] if chunks == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    return sched, models


def _rank(rank, world_size, name, m, reps, versus, windows, config=None, calibrate=True):
    """Time mlmkit's step for ``name`` against ``versus`` ("torch": torch's runtime on the same
    schedule; or another mlmkit schedule name) and calibrate the simulator, ``windows`` times in a
    row (``reps`` paired steps, then a calibration): per window, (our wall times, their wall times,
    our CPU times, their CPU times, calibrated costs, message latency); and the schedule.
    ``config``: the model (default :data:`CFG`); ``calibrate=False``: costs and latency are None."""
    cfg = config or CFG
    groups = ProcessGroups.build(Topology(pp=world_size))
    chunks = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev", "torch:interleaved-zb") else 1
    theirs_sched, theirs_models = (None, None)
    if versus == "torch":
        theirs_sched, theirs_models = _torch_side(groups, name, m, chunks, cfg)
    if name == "torch:interleaved-zb":     # torch's order, run by mlmkit's executor
        schedule = from_torch(theirs_sched, name=name)
    else:
        schedule = make_schedule(name, stages=world_size, microbatches=m, chunks=chunks)
    ours_models = build_model_chunks(cfg, groups=groups, chunks=chunks, placement=schedule.placement,
                                     split_backward=schedule.split_backward)
    ours = PipelineExecutor(schedule=schedule, chunks=ours_models, groups=groups)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (m * MB, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (m * MB, cfg.seq_len), generator=g)

    cpu = {"ours": [], "theirs": []}         # this rank's CPU seconds per step (gloo's threads included)

    def timed(side, fn):
        def step():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, used = time.perf_counter() - t0, time.process_time() - c0
            cpu[side].append(used)
            return wall
        return step

    def run_ours():
        ours.run_step(tokens, targets)
        for model in ours_models:
            model.zero_grad(set_to_none=True)

    if versus == "torch":
        first = any(mod.stage.pre_process for mod in theirs_models)
        last = any(mod.stage.post_process for mod in theirs_models)

        def run_theirs():
            kwargs = dict(target=targets, losses=[]) if last else {}
            theirs_sched.step(*((tokens,) if first else ()), **kwargs)
            for model in theirs_models:
                model.zero_grad(set_to_none=True)
    else:
        base = make_schedule(versus, stages=world_size, microbatches=m)
        base_models = build_model_chunks(cfg, groups=groups)
        for theirs, mine in zip(base_models, ours_models):      # the same weights on both sides
            theirs.load_state_dict(mine.state_dict())
        base_ex = PipelineExecutor(schedule=base, chunks=base_models, groups=groups)

        def run_theirs():
            base_ex.run_step(tokens, targets)
            for model in base_models:
                model.zero_grad(set_to_none=True)

    step_ours, step_theirs = timed("ours", run_ours), timed("theirs", run_theirs)
    for _ in range(2):
        step_ours(), step_theirs()
    out = []
    for _ in range(windows):
        for times in cpu.values():
            times.clear()
        t_ours, t_theirs = alternate(step_ours, step_theirs, reps, warmup=0)
        c_ours, c_theirs = list(cpu["ours"]), list(cpu["theirs"])
        costs = base_costs = latency = None
        if calibrate:
            costs = measure_costs(schedule, ours_models, groups, tokens[:MB], targets[:MB])
            costs = measure_overhead(ours, costs, tokens, targets)
            if versus != "torch":         # the other mlmkit schedule, calibrated in the same minute
                base_costs = measure_costs(base, base_models, groups, tokens[:MB], targets[:MB])
                base_costs = measure_overhead(base_ex, base_costs, tokens, targets)
            latency = _p2p_latency(groups, (cfg.seq_len, MB, cfg.hidden))
        out.append((t_ours, t_theirs, c_ours, c_theirs, costs, latency, base_costs))
    if calibrate:       # steps after the last calibration too: each calibration has steps on both sides
        for times in cpu.values():
            times.clear()
        t_ours, t_theirs = alternate(step_ours, step_theirs, reps, warmup=0)
        out.append((t_ours, t_theirs, list(cpu["ours"]), list(cpu["theirs"]), None, None, None))
    return out, schedule


CASES = [("gpipe", "torch"), ("1f1b", "torch"), ("zb-h1", "1f1b"), ("interleaved-1f1b", "torch"),
         ("torch:interleaved-zb", "torch"), ("zb-v", "torch"), ("dualpipev", "torch")]


def run(quick: bool = False) -> list[Row]:
    from dataclasses import replace

    windows, reps = (1, 6) if quick else (3, 5)        # reps: paired steps per window
    cores = os.cpu_count() or 1
    rows = []
    for pp in (2, 4):
        m = 2 * pp
        one_core = []          # zb-h1 against 1f1b with one core per rank, per window: (zb-h1, 1f1b)
        for name, versus in CASES:
            res = run_ranks(_rank, world_size=pp, args=(name, m, reps, versus, windows), timeout_s=900)
            schedule = res[0][1]
            steps = {"ours": [], "theirs": []}
            cpu = {"ours": [], "theirs": []}
            sims, measured = [], []
            base = make_schedule(versus, stages=pp, microbatches=m) if name == "zb-h1" else None
            for w in range(len(res[0][0])):                         # the windows, then the last steps
                win = [r[0][w] for r in res]                         # win[rank]
                for side, k in (("ours", 0), ("theirs", 1)):
                    steps[side] += [max(r[k][i] for r in win) for i in range(reps)]   # the slowest rank's
                    cpu[side] += [sum(r[k + 2][i] for r in win) for i in range(reps)]  # all ranks' CPU
                if w == 0:
                    continue
                # window w - 1's calibration against the steps on both sides of it (its own, then w's)
                before = [r[0][w - 1] for r in res]
                calibrated = replace(before[0][4], p2p_latency=before[0][5])
                sims.append(simulate(schedule, calibrated, cores=cores).step_time)
                measured.append(median(steps["ours"][-2 * reps:]))
                if base is not None:
                    one_core.append((simulate(schedule, calibrated).step_time,
                                     simulate(base, replace(before[0][6], p2p_latency=before[0][5])).step_time))
            ours, theirs, ratio = paired(steps["ours"], steps["theirs"])
            what = "pipeline step vs torch.distributed.pipelining" if versus == "torch" else f"{name} step vs {versus}"
            against = TORCH_CLASS.get(name, "") if versus == "torch" else f"mlmkit {versus}"
            rows.append(Row(what, f"{name}, pp={pp}, m={m} (vs {against})", ours * 1e3, theirs * 1e3, "ms",
                            "<= 1.0", ratio <= 1.0, ratio=ratio))
            if versus != "torch":
                # Where the time goes: CPU time of all ranks per step, and the cores' idle time
                # (cores x step - CPU) that a zero-bubble schedule is meant to fill.
                idle = {side: median([cores * t - c for t, c in zip(steps[side], cpu[side])]) for side in steps}
                rows.append(Row(f"{name} vs {versus}: CPU time per step, all ranks", f"pp={pp}, m={m}, {cores} cores",
                                median(cpu["ours"]) * 1e3, median(cpu["theirs"]) * 1e3, "ms", "n/a (reported)", None,
                                ratio=median([a / b for a, b in zip(cpu["ours"], cpu["theirs"])]),
                                note=f"idle core time per step ({cores} cores x step - CPU): {name} {idle['ours'] * 1e3:.0f} ms, "
                                     f"{versus} {idle['theirs'] * 1e3:.0f} ms"))
            sim_ratio = median([sim / meas for sim, meas in zip(sims, measured)])
            err = abs(sim_ratio - 1)
            note = f"error {err:.1%}"
            if windows > 1:
                note += (f"; median of {windows} windows, each a calibration against the steps before and after it; "
                         f"measured spread {max(measured) / min(measured):.2f}x")
            rows.append(Row("simulated vs measured step (calibrated)", f"{name}, pp={pp}, m={m}, {cores} cores",
                            median(sims) * 1e3, median(measured) * 1e3, "ms", "within 15%",
                            err <= 0.15, ratio=sim_ratio, note=note))
        # With fewer cores than ranks a bubble is not idle time (another rank computes), so there is
        # little for zero bubble to recover: what it does with one core per rank. Both schedules'
        # costs come from the zb-h1 case's windows, each calibrated right after the other on the same
        # ranks (calibrations minutes apart, in the 1f1b case's run, differ by more than what is compared).
        zb_t, ofob_t, ratio = paired([z for z, _ in one_core], [o for _, o in one_core])
        rows.append(Row("zb-h1 step vs 1f1b, simulated", f"pp={pp}, m={m}, one core per rank",
                        zb_t * 1e3, ofob_t * 1e3, "ms", "<= 1.0", ratio <= 1.0, ratio=ratio,
                        note=f"each window's calibrations of both (the zb-h1 case's); median of {len(one_core)} paired ratios"))
        # The same comparison where the weight-gradient GEMMs, not the split's fixed costs, decide W.
        res = run_ranks(_rank, world_size=pp, args=("zb-h1", m, reps, "1f1b", windows),
                        kwargs=dict(config=WIDE, calibrate=False), timeout_s=900)
        steps = {"ours": [], "theirs": []}
        for w in range(windows):
            win = [r[0][w] for r in res]
            for side, k in (("ours", 0), ("theirs", 1)):
                steps[side] += [max(r[k][i] for r in win) for i in range(reps)]
        ours, theirs, ratio = paired(steps["ours"], steps["theirs"])
        rows.append(Row("zb-h1 step vs 1f1b, GEMM-bound width", f"zb-h1, pp={pp}, m={m}, hidden {WIDE.hidden} "
                        f"(vs mlmkit 1f1b)", ours * 1e3, theirs * 1e3, "ms", "<= 1.0", ratio <= 1.0, ratio=ratio))
    return rows
