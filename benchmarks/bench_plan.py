"""The planner against published end-to-end results, and its speed.

Published rows (:mod:`mlmkit.plan.published`): Narayanan et al. 2021 (Megatron-LM on up to 3072
A100s, hardware TFLOP/s with full recomputation) and Dubey et al. 2024 (Llama 3 405B on 8K-16K
H100s, model TFLOP/s); the planner predicts each under the published degrees (its best
micro-batch size and schedule, which the tables do not give). Target: within 15%.

Speed: the whole search for GPT-3 175B on 1024 A100s (target <= 5 s) and ``simulate`` of
interleaved 1F1B at p=64, m=512, v=4 (target <= 1 s), wall clock on this machine.
"""

from __future__ import annotations

import time

from benchmarks.common import Row


def run(quick: bool = False) -> list[Row]:
    from mlmkit.model.presets import preset
    from mlmkit.pipeline import make_schedule, simulate
    from mlmkit.plan import plan
    from mlmkit.plan.published import comparison

    rows = []
    for d in comparison().to_dict("records"):
        ok = abs(d["ratio"] - 1) <= 0.15
        choice = d["planner's choice"]
        note = f"{d['flops']} FLOP/s; planner's choice: {choice}; {d['source']}"
        rows.append(Row(f"planner vs published: {d['result']}", f"{d['gpus']} x {d['gpu']}, {d['layout']}",
                        d["predicted TFLOP/s"], float(d["published TFLOP/s"]), "TFLOP/s/GPU", "within 15%", ok,
                        note=note))
    t0 = time.perf_counter()
    table = plan(preset("gpt3-175b"), gpus=1024, gpu="a100-80gb", global_batch_size=1536, seq_len=2048)
    elapsed = time.perf_counter() - t0
    rows.append(Row("planner search time", f"GPT-3 175B, 1024 A100s: {len(table)} layouts", elapsed, 5.0, "s",
                    "<= 5 s", elapsed <= 5.0, note="the limit as baseline"))
    schedule = make_schedule("interleaved-1f1b", stages=64, microbatches=512, chunks=4)
    t0 = time.perf_counter()
    simulate(schedule, {"forward": 1.0, "backward": 2.0})
    elapsed = time.perf_counter() - t0
    rows.append(Row("simulate time", "interleaved-1f1b p=64 m=512 v=4 (786,432 actions)", elapsed, 1.0, "s",
                    "<= 1 s", elapsed <= 1.0, note="the limit as baseline"))
    return rows
