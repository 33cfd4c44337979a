"""Peak memory per rank, measured (exact CPU accounting) against the estimator, tp=2 x pp=2."""

from __future__ import annotations

from benchmarks.common import Row
from mlmkit.distributed import run_ranks
from mlmkit.estimate import estimate_memory
from mlmkit.estimate.compare import measured_memory
from mlmkit.model import GPTConfig
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import traced_step

CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=128, hidden=128, heads=4, layers=4), tp=2, pp=2,
                  micro_batch_size=4, global_batch_size=32)


def run(quick: bool = False) -> list[Row]:
    traces = merge_traces(run_ranks(traced_step, world_size=4, args=(CFG.to_dict(),), timeout_s=600))
    measured = measured_memory(traces["memory"])
    measured["total"] = measured.sum(axis=1)
    est = estimate_memory(CFG.model, CFG.topology, micro_batch_size=CFG.micro_batch_size, microbatches=CFG.microbatches,
                          precision=CFG.precision)
    rows = []
    for rank in est.index:
        m, e = float(measured.loc[rank, "total"]), float(est.loc[rank, "total"])
        rows.append(Row("peak memory per rank: measured vs estimated", f"rank {rank}, tp=2 x pp=2, 1F1B m=8",
                        m / 2**20, e / 2**20, "MiB", "within 10%", abs(m / e - 1) <= 0.10))
    return rows
