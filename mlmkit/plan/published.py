"""Published end-to-end training results, to hold the planner's predictions against (pure data).

Each row: the model's shape, the GPUs, the published layout and the published throughput.
Narayanan et al. 2021 report hardware FLOP/s with full recomputation (their eq. 3 counts the
recomputed forward; mixed precision, no flash attention, 51,200-token vocabulary, sequence 2048);
their table gives tp, pp, GPUs and batch, not the micro-batch size or the schedule, so the
planner is asked for its best micro-batch size and schedule under the published degrees. Dubey
et al. 2024 (Llama 3 405B) report model FLOP/s and MFU (BF16) for tp 8, pp 16 with cp 1 and 16.
"""

from __future__ import annotations

NARAYANAN_2021 = "https://arxiv.org/abs/2104.04473"   # table 1 ("weak-scaling throughput")
LLAMA3_2024 = "https://arxiv.org/abs/2407.21783"       # table 4 (scaling configurations, 405B)

#: (name, dict(hidden, heads, layers), gpus, tp, cp, pp, global batch, seq, published TFLOP/s per GPU,
#: "hardware" or "model" FLOPs, GPU preset, source)
ROWS = [
    ("GPT 1.7B", dict(hidden=2304, heads=24, layers=24), 32, 1, 1, 1, 512, 2048, 137, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 3.6B", dict(hidden=3072, heads=32, layers=30), 64, 2, 1, 1, 512, 2048, 138, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 7.5B", dict(hidden=4096, heads=32, layers=36), 128, 4, 1, 1, 512, 2048, 142, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 18.4B", dict(hidden=6144, heads=48, layers=40), 256, 8, 1, 1, 1024, 2048, 135, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 39.1B", dict(hidden=8192, heads=64, layers=48), 512, 8, 1, 2, 1536, 2048, 138, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 76.1B", dict(hidden=10240, heads=80, layers=60), 1024, 8, 1, 4, 1792, 2048, 140, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 145.6B", dict(hidden=12288, heads=96, layers=80), 1536, 8, 1, 8, 2304, 2048, 148, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 310.1B", dict(hidden=16384, heads=128, layers=96), 1920, 8, 1, 16, 2160, 2048, 155, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 529.6B", dict(hidden=20480, heads=128, layers=105), 2520, 8, 1, 35, 2520, 2048, 163, "hardware", "a100-80gb", NARAYANAN_2021),
    ("GPT 1008.0B", dict(hidden=25600, heads=160, layers=128), 3072, 8, 1, 64, 3072, 2048, 163, "hardware", "a100-80gb", NARAYANAN_2021),
    ("Llama 3 405B, 8K", "llama3-405b", 8192, 8, 1, 16, 2048, 8192, 430, "model", "h100-sxm", LLAMA3_2024),
    ("Llama 3 405B, 8K", "llama3-405b", 16384, 8, 1, 16, 2048, 8192, 400, "model", "h100-sxm", LLAMA3_2024),
    ("Llama 3 405B, 128K", "llama3-405b", 16384, 8, 16, 16, 128, 131072, 380, "model", "h100-sxm", LLAMA3_2024),
]


def comparison():
    """One row per published result: the planner's best prediction under the published degrees."""
    import pandas as pd

    from mlmkit.model import GPTConfig
    from mlmkit.model.presets import preset
    from mlmkit.plan.search import plan

    out = []
    for name, shape, gpus, tp, cp, pp, batch, seq, published, kind, gpu, source in ROWS:
        if isinstance(shape, str):
            model, flash, constraints = preset(shape, seq_len=seq), True, {}
        else:   # 2021: full recomputation, dropout 0.1, no flash attention, no sequence parallelism
            model = GPTConfig(vocab_size=51200, seq_len=seq, dropout=0.1, **shape)
            flash, constraints = False, {"recompute": "full", "zero": 1, "sequence_parallel": False}
        table = plan(model, gpus=gpus, gpu=gpu, global_batch_size=batch, seq_len=seq, tp=tp, cp=cp, pp=pp,
                     flash_attention=flash, **constraints)
        best = table.iloc[0]
        predicted = best[f"{kind}_tflops_per_gpu"]
        # When the planner recomputes only because its memory model finds no room (the report does not
        # say), its time model is also shown without recomputation, and the memory that would take.
        free = {}
        if best["recompute"] != "none" and "recompute" not in constraints:
            bare = plan(model, gpus=gpus, gpu=gpu, global_batch_size=batch, seq_len=seq, tp=tp, cp=cp, pp=pp,
                        flash_attention=flash, recompute="none")
            bare = bare.loc[bare.tokens_per_s.idxmax()]     # the fastest, fitting or not (none fits here)
            free = {"without recomputation TFLOP/s": round(float(bare[f"{kind}_tflops_per_gpu"]), 1),
                    "without recomputation GiB": round(float(bare["memory_per_gpu_bytes"]) / 2**30, 1),
                    "without recomputation fits": bool(bare["fits"])}
        out.append({"result": name, "gpus": gpus, "gpu": gpu, "layout": f"tp{tp} cp{cp} pp{pp} dp{gpus // (tp * cp * pp)}",
                    "published TFLOP/s": published, "predicted TFLOP/s": round(float(predicted), 1),
                    "ratio": float(predicted) / published, "flops": kind, "fits": bool(best["fits"]),
                    "planner's choice": f"mbs {best['micro_batch_size']}, {best['schedule']} v{best['chunks']}, "
                                        f"recompute {best['recompute']}, zero {best['zero']}",
                    "source": source, **free})
    return pd.DataFrame(out)
