"""The planner against published end-to-end results, and its speed.

Published rows (:mod:`mlmkit.plan.published`): Narayanan et al. 2021 (Megatron-LM on up to 3072
A100s, hardware TFLOP/s with full recomputation) and Dubey et al. 2024 (Llama 3 405B on 8K-16K
H100s, model TFLOP/s); the planner predicts each under the published degrees (its best
micro-batch size and schedule, which the tables do not give). Target: within 15%.

Speed: the whole search for GPT-3 175B on 1024 A100s (target <= 5 s) and ``simulate`` of
interleaved 1F1B at p=64, m=512, v=4 (target <= 1 s), wall clock on this machine.

Closing the loop on this machine: ``local-cpu`` is calibrated (:func:`mlmkit.distributed.calibrate_local_cpu`,
4 ranks), then the quickstart model is trained under each of :data:`LOCAL_LAYOUTS` on 4 CPU ranks,
each layout in fresh processes as a user runs one (``python -m mlmkit.train`` or ``torchrun``), and
each measured step is set beside the planner's prediction (target: within 15%); five times in a
row, calibration and measurement in the same window (:func:`local_comparison`). The ranking check
takes :data:`RANKED`, six layouts chosen before any prediction was made so that their measured
steps lie at least 1.3x apart (closer ones swap with this machine's noise): the planner must put
them in the measured order.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from benchmarks.common import Row


#: The quickstart model's layouts on 4 CPU ranks (TrainConfig overrides of demo_config).
LOCAL_LAYOUTS = {
    "dp4": dict(tp=1, pp=1, dp=4),
    "dp4 zero3": dict(tp=1, pp=1, dp=4, zero=3),
    "tp2 dp2": dict(tp=2, pp=1, dp=2),
    "tp2 dp2 recompute": dict(tp=2, pp=1, dp=2, recompute="full"),
    "tp4": dict(tp=4, pp=1, dp=1),
    "pp2 dp2": dict(tp=1, pp=2, dp=2),
    "pp2 dp2 mbs2": dict(tp=1, pp=2, dp=2, micro_batch_size=2),
    "pp2 dp2 mbs1": dict(tp=1, pp=2, dp=2, micro_batch_size=1),
    "pp4": dict(tp=1, pp=4, dp=1),
    "pp4 mbs1": dict(tp=1, pp=4, dp=1, micro_batch_size=1),
    "tp2 pp2": dict(tp=2, pp=2, dp=1),
    "tp2 pp2 interleaved": dict(tp=2, pp=2, dp=1, schedule="interleaved-1f1b", chunks=2),
    "tp2 dp2 sp": dict(tp=2, pp=1, dp=2, sequence_parallel=True),
    "tp4 sp": dict(tp=4, pp=1, dp=1, sequence_parallel=True),
}
RANKED = ["pp2 dp2", "pp2 dp2 mbs2", "dp4 zero3", "tp2 dp2", "tp2 pp2 interleaved", "tp4"]


def _time_on_ranks(rank, world_size, configs, steps, rounds):
    import torch

    from mlmkit.train import time_layouts

    torch.manual_seed(0)
    return time_layouts(configs, steps=steps, rounds=rounds)


def local_comparison(*, quick: bool = False, hw=None, windows: int = 5):
    """(DataFrame of predicted and measured step per layout, the last calibrated Hardware).

    ``windows`` times in a row: calibrate ``local-cpu`` (one repeat), then time every layout, each
    in its own fresh processes (:func:`mlmkit.distributed.run_ranks`), so that each prediction and
    its measurement come from the same stretch of time (a machine shared with others slows down for
    minutes at a time). Fresh processes, not one process per rank holding every layout's trainer:
    each trainer's process groups bring gloo threads that wake up now and then, and with a dozen
    of them the virtual CPUs rarely go idle, so waking a rank for a collective gets cheaper (tp4:
    600 ms a step with its own groups only, 460 ms with 11 more unused ones) and no user runs like
    that. The table gives per layout the median prediction, the median measurement, the median of
    the paired ratios and the spread of the measurement over the windows (largest / smallest)."""
    import statistics

    import pandas as pd

    from mlmkit.distributed import calibrate_local_cpu, run_ranks
    from mlmkit.plan import Layout, predict
    from mlmkit.train import demo_config

    configs = [demo_config(**kw, tracing=False) for kw in LOCAL_LAYOUTS.values()]
    windows = 1 if quick or hw is not None else windows
    preds, meas = [], []
    for _ in range(windows):
        hw_i = hw or calibrate_local_cpu(4, quick=quick, repeats=1)
        meas.append([run_ranks(_time_on_ranks, world_size=4, args=([c], 4 if quick else 6, 1), timeout_s=600)[0][0]
                     for c in configs])
        preds.append([predict(c.model, hw_i, Layout.of(c), global_batch_size=c.global_batch_size)["step_time_s"]
                      for c in configs])
    med = statistics.median
    rows = []
    for i, name in enumerate(LOCAL_LAYOUTS):
        p, m = [w[i] for w in preds], [w[i] for w in meas]
        rows.append({"layout": name, "predicted_s": med(p), "measured_s": med(m),
                     "ratio": med(a / b for a, b in zip(p, m)), "spread": max(m) / min(m)})
    frame = pd.DataFrame(rows).set_index("layout")
    frame.attrs["windows"] = windows
    return frame, hw_i


def _same_order_pairs(pred, meas) -> tuple[int, int]:
    names = list(pred)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    same = sum((pred[a] - pred[b]) * (meas[a] - meas[b]) > 0 for a, b in pairs)
    return same, len(pairs)


def local_rows(quick: bool = False) -> list[Row]:
    frame, hw = local_comparison(quick=quick)
    rows = []
    for name, r in frame.iterrows():
        ok = abs(r.ratio - 1) <= 0.15
        rows.append(Row("planner local-cpu vs measured step", f"quickstart, 4 CPU ranks, {name}", r.predicted_s * 1e3,
                        r.measured_s * 1e3, "ms", "within 15%", ok, ratio=r.ratio,
                        note=f"medians over {frame.attrs['windows']} windows of calibration + measurement (each layout in fresh "
                             f"processes); ratio: median of the paired ratios; measured spread {r.spread:.2f}x"))
    ranked = frame.loc[RANKED]
    same, total = _same_order_pairs(ranked.predicted_s.to_dict(), ranked.measured_s.to_dict())
    order = " < ".join(ranked.sort_values("measured_s").index)
    rows.append(Row("planner local-cpu ranking", f"{len(RANKED)} layouts: pairs in the measured order", same, total,
                    "pairs", "all", same == total, note=f"measured: {order}"))
    allsame, alltotal = _same_order_pairs(frame.predicted_s.to_dict(), frame.measured_s.to_dict())
    rows.append(Row("planner local-cpu ranking", f"all {len(frame)} layouts: pairs in the measured order", allsame,
                    alltotal, "pairs", "n/a", None, note="includes layouts whose steps differ by less than the noise"))
    return rows


def run(quick: bool = False) -> list[Row]:
    from mlmkit.model.presets import preset
    from mlmkit.pipeline import make_schedule, simulate
    from mlmkit.plan import plan
    from mlmkit.plan.published import comparison

    rows = []
    for d in comparison().to_dict("records"):
        ok = abs(d["ratio"] - 1) <= 0.15
        choice = d["planner's choice"]
        note = f"{d['flops']} FLOP/s; planner's choice: {choice}"
        bare = d.get("without recomputation TFLOP/s")          # NaN (or absent) where it did not recompute
        if bare is not None and not math.isnan(bare):
            note += (f"; without recomputation {bare:.1f} TFLOP/s ({bare / float(d['published TFLOP/s']):.2f}x), "
                     f"{d['without recomputation GiB']:.0f} GiB per GPU by the memory model"
                     f"{'' if d['without recomputation fits'] else ' (does not fit)'}")
        note += f"; {d['source']}"
        rows.append(Row(f"planner vs published: {d['result']}", f"{d['gpus']} x {d['gpu']}, {d['layout']}",
                        d["predicted TFLOP/s"], float(d["published TFLOP/s"]), "TFLOP/s/GPU", "within 15%", ok,
                        note=note))
    t0 = time.perf_counter()
    table = plan(preset("gpt3-175b"), gpus=1024, gpu="a100-80gb", global_batch_size=1536, seq_len=2048)
    elapsed = time.perf_counter() - t0
    rows.append(Row("planner search time", f"GPT-3 175B, 1024 A100s: {len(table)} layouts", elapsed, 5.0, "s",
                    "<= 5 s", elapsed <= 5.0, note="the limit as baseline"))
    # a fine-grained mixture (DeepSeek-V3's 61 layers and 256 routed experts, top-8, on Mixtral's
    # widths): its search listed every expert's tensors and took 31 s before the stage sums were
    # counted from one layer per stage
    moe = replace(preset("mixtral-8x7b"), layers=61, experts=256, top_k=8)
    t0 = time.perf_counter()
    table = plan(moe, gpus=1024, gpu="h100-sxm", global_batch_size=1024, seq_len=4096)
    elapsed = time.perf_counter() - t0
    rows.append(Row("planner search time", f"61 layers x 256 experts (top-8), 1024 H100s: {len(table)} layouts",
                    elapsed, 5.0, "s", "<= 5 s", elapsed <= 5.0, note="the limit as baseline"))
    schedule = make_schedule("interleaved-1f1b", stages=64, microbatches=512, chunks=4)
    t0 = time.perf_counter()
    simulate(schedule, {"forward": 1.0, "backward": 2.0})
    elapsed = time.perf_counter() - t0
    rows.append(Row("simulate time", "interleaved-1f1b p=64 m=512 v=4 (786,432 actions)", elapsed, 1.0, "s",
                    "<= 1 s", elapsed <= 1.0, note="the limit as baseline"))
    return rows + local_rows(quick)
