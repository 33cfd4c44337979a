"""`make bench` / `python -m benchmarks [--quick] [--only NAME]`: run every benchmark, print one table,
write benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks import (bench_cluster, bench_context_parallel, bench_llama, bench_memory, bench_model, bench_moe,
                        bench_pipeline, bench_plan, bench_tp_mlp, bench_tracing, bench_zero)
from benchmarks.common import format_table, write_results

# In the order of the table: model step, Llama-style step and bf16, TP layer, pipeline (+ simulator), context
# parallelism, mixture of experts, tracing, cluster, memory.
BENCHMARKS = {"model": bench_model, "llama": bench_llama, "tp_mlp": bench_tp_mlp, "pipeline": bench_pipeline,
              "context_parallel": bench_context_parallel, "moe": bench_moe, "zero": bench_zero, "tracing": bench_tracing,
              "cluster": bench_cluster, "plan": bench_plan,
              "memory": bench_memory}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, mod in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows += mod.run(quick=args.quick)
    print(format_table(rows))
    notes_path = os.path.join(os.path.dirname(__file__), "NOTES.md")
    notes = open(notes_path).read() if os.path.exists(notes_path) else ""
    write_results(rows, command="make bench" + (" (--quick)" if args.quick else ""), path=args.out, explanations=notes)
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
