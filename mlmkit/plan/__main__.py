"""``python -m mlmkit.plan``: the best layouts of a job, predicted (see :func:`mlmkit.plan.plan`).

Example::

    python -m mlmkit.plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch-size 1536 \\
        --seq-len 2048 --tp 8 --top 5

Given flags (``--tp --cp --pp --dp --ep --chunks --schedule --micro-batch-size --recompute --zero``)
constrain the search; the rest is searched. ``--json`` prints one JSON object per layout.

``--gpu local-cpu`` first measures this machine for ``--gpus`` CPU ranks (about 30 s; ``--quick``:
about 5 s, noisier) and predicts mlmkit's own runs on them, e.g. the quickstart model::

    python -m mlmkit.plan --model quickstart --gpus 4 --gpu local-cpu --global-batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from mlmkit.model.config import GPTConfig, top_1_refusal
from mlmkit.model.presets import PRESETS, preset
from mlmkit.plan.hardware import GPUS, hardware
from mlmkit.plan.search import check_request, plan
from mlmkit.pipeline.schedule import SCHEDULES
from mlmkit.plan.timing import check_mlmkit_runtime

SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size", "experts", "top_k")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m mlmkit.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(PRESETS))}) or a JSON file of "
                                                  f"GPTConfig fields")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(sorted(GPUS))}, or local-cpu (measured "
                                                     f"on this machine for --gpus CPU ranks)")
    p.add_argument("--quick", action="store_true", help="local-cpu: a shorter, noisier calibration")
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    for name in ("tp", "cp", "pp", "dp", "ep", "chunks", "micro-batch-size", "zero"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--schedule", choices=list(SCHEDULES),
                   help="GPU presets model Megatron-LM's 1f1b and interleaved-1f1b (searched by default); "
                        "local-cpu simulates any of them")
    p.add_argument("--recompute", choices=["none", "selective", "full"])
    for name in SHAPE:
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--moe-renormalize", action=argparse.BooleanOptionalAction, default=None,
                   help="rescale a token's top-k expert weights to sum to 1 (the presets' default); "
                        "--no-moe-renormalize keeps the raw router scores (Switch; needed with --top-k 1)")
    p.add_argument("--no-flash-attention", action="store_true",
                   help="attention as separate kernels (the [s, s] scores go through memory)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10; 0: every layout)")
    p.add_argument("--json", action="store_true", help="one JSON object per layout")
    return p.parse_args(argv)


def _model(args) -> GPTConfig:
    if args.model in PRESETS or (not os.path.exists(args.model) and args.model.strip().lower() in PRESETS):
        model = preset(args.model)              # a file of that name wins over another spelling of a preset
    else:
        try:
            with open(args.model) as f:
                model = GPTConfig.from_dict(json.load(f))
        except OSError as err:
            raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                             f"readable JSON file: {err}") from None
    shape = {k: getattr(args, k) for k in SHAPE + ("moe_renormalize",) if getattr(args, k) is not None}
    experts = shape.get("experts", model.experts)
    if experts and shape.get("top_k", model.top_k) == 1 and shape.get("moe_renormalize", model.moe_renormalize):
        # GPTConfig refuses it naming a config field, which a command line has not got
        said = "--top-k 1" if args.top_k is not None else f"{args.model}'s top_k=1"
        raise ValueError(top_1_refusal(said))
    model = replace(model, **shape) if shape else model
    given = [f"--{'no-' if getattr(args, k) is False else ''}{k.replace('_', '-')}"
             for k in ("top_k", "moe_renormalize") if getattr(args, k) is not None]
    if given and not model.moe:           # they changed nothing
        raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a mixture of experts, and "
                         f"this model has none: add --experts N")
    return model


def _say_nothing_fits(best, memory: float) -> None:
    """On stderr: no layout fits in ``memory`` bytes per GPU; what the closest one (``best``) needs."""
    gib = 2**30
    state, acts = best.state_bytes, best.activation_bytes
    other = best.memory_per_gpu_bytes - state - acts
    fix = ("the state alone is more than a GPU holds: add GPUs" if state > memory else
           "add GPUs, or shorten the sequence (activations)")
    print(f"python -m mlmkit.plan: no layout fits in {memory / gib:.0f} GiB per GPU; the closest (rank 0: "
          f"tp={best.tp} cp={best.cp} pp={best.pp} dp={best.dp}, zero={best.zero}, recompute={best.recompute}) needs "
          f"{best.memory_per_gpu_bytes / gib:.0f} GiB: weights, gradients and optimizer state {state / gib:.0f} GiB, "
          f"activations {acts / gib:.0f} GiB, framework buffers {other / gib:.0f} GiB; {fix}.", file=sys.stderr)


def main(argv=None) -> int:
    args = _parse(argv)
    constraints = {k: getattr(args, k) for k in ("tp", "cp", "pp", "dp", "ep", "chunks", "schedule",
                                                  "micro_batch_size", "recompute", "zero")}
    try:
        model = _model(args)
        gpu = args.gpu
        if gpu.strip().lower() == "local-cpu":
            # what the calibration cannot change fails first, not after half a minute of measuring
            # (and before torch is imported: a refusal takes a fifth of a second, not two and a half)
            check_request(gpus=args.gpus, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
                          top=args.top, **constraints)
            check_mlmkit_runtime(model, cp=args.cp, ep=args.ep)
            from mlmkit.distributed.launch import max_local_ranks     # imports no torch

            limit = max_local_ranks()
            if args.gpus > limit:
                raise ValueError(
                    f"--gpus {args.gpus} with --gpu local-cpu: local-cpu measures and predicts runs of one process "
                    f"per rank on this machine, whose available memory holds at most {limit} CPU ranks; plan for "
                    f"at most {limit} ranks on local-cpu, or for GPUs with a preset (--gpu h100-sxm)")
            from mlmkit.distributed import calibrate_local_cpu

            print(f"calibrating local-cpu for {args.gpus} ranks ...", file=sys.stderr, flush=True)
            gpu = calibrate_local_cpu(args.gpus, quick=args.quick)
            print(gpu.source, file=sys.stderr)
        table = plan(model, gpus=args.gpus, gpu=gpu, global_batch_size=args.global_batch_size,
                     seq_len=args.seq_len, flash_attention=not args.no_flash_attention, top=args.top,
                     **{k: v for k, v in constraints.items() if v is not None})
    except ValueError as err:
        print(f"python -m mlmkit.plan: {err}", file=sys.stderr)
        return 2
    if not table.fits.iloc[0]:
        _say_nothing_fits(table.iloc[0], hardware(gpu).memory_bytes)
    if args.json:
        for rank, row in table.iterrows():
            print(json.dumps({"rank": int(rank), **{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}}))
        return 0
    shown = table.assign(memory_gib=table.memory_per_gpu_bytes / 2**30, step_s=table.step_time_s,
                         mfu_pct=table.mfu * 100)
    cols = ["tp", "cp", "pp", "dp"] + (["ep"] if model.moe else []) + [
        "chunks", "schedule", "micro_batch_size", "recompute", "zero", "memory_gib", "fits", "step_s", "tokens_per_s",
        "model_tflops_per_gpu", "mfu_pct"]
    print(shown[cols].to_string(float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
