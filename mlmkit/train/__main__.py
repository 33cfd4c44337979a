"""Batch entry point: ``torchrun --nproc-per-node N -m mlmkit.train [--config run.json] [flags]``.

Runs the same Trainer as the notebooks. Without ``--config`` it trains the quickstart model
(:func:`mlmkit.train.demo_config`). Flags override config fields. The world size (from torchrun)
must equal tp*cp*pp*dp (ep and expert-tp fold into tp*cp*dp). Under Slurm, see ``cluster/slurm_train.sbatch``.
It records no traces (``tracing`` is off whatever the config says): the notebooks' cluster sessions
show them.
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import json
import os
import sys

from mlmkit.model.config import top_1_refusal
from mlmkit.pipeline.schedule import SCHEDULES, V_SCHEDULES
from mlmkit.train.config import TrainConfig, check_corpus, demo_config, is_schedule_file


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m mlmkit.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON file with TrainConfig fields (model as a nested object)")
    for name in ("tp", "pp", "dp", "cp", "ep", "expert-tp", "chunks", "micro-batch-size", "global-batch-size", "max-steps", "warmup-steps",
                 "microbatch-group"):
        p.add_argument(f"--{name}", type=int)
    for name in ("lr", "min-lr", "grad-clip", "weight-decay"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--schedule", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v or dualpipev, or a CSV file in torch's "
                                      "pipeline format (mlmkit.pipeline.to_torch_csv writes one); without --chunks, the "
                                      "chunks it runs (2 for zb-v, dualpipev and interleaved-1f1b, the file's, else 1)")
    p.add_argument("--cp-split", choices=["balanced", "naive"],
                   help="how --cp divides each sequence: balanced (2cp chunks, Megatron-LM's) or naive")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP)")
    p.add_argument("--zero1", action="store_true", default=None, help="the same as --zero 1")
    p.add_argument("--prefetch", type=int, choices=[0, 1], help="--zero 3: layers gathered ahead of use")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false", default=None,
                   help="--zero 3: keep gathered parameters until the optimizer step")
    p.add_argument("--sequence-parallel", action="store_true", default=None)
    p.add_argument("--recompute", action="store_true", default=None,
                   help="recompute activations in backward (each full layer, or --recompute-granularity)")
    p.add_argument("--recompute-granularity", choices=["selective", "full"],
                   help="what --recompute reruns: the attention core (selective) or each layer (full)")
    p.add_argument("--arch", choices=["gpt", "llama"],
                   help="blocks of the model: GPT-2 (LayerNorm, GELU, learned positions, biases, tied) or "
                        "Llama (RMSNorm, SwiGLU, rotary positions, no biases, untied); sizes are kept")
    p.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    p.add_argument("--experts", type=int, help="experts per layer: every MLP becomes a mixture of experts")
    p.add_argument("--top-k", type=int, help="experts each token goes to (with --experts)")
    p.add_argument("--moe-renormalize", action=argparse.BooleanOptionalAction, default=None,
                   help="rescale a token's top-k expert weights to sum to 1 (Mixtral; the default); "
                        "--no-moe-renormalize keeps the raw router scores (Switch; needed with --top-k 1)")
    p.add_argument("--moe-aux-loss-coeff", type=float, help="weight of the load-balancing loss")
    p.add_argument("--moe-capacity-factor", type=float, help="expert capacity factor (default: dropless)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: mixed precision as Megatron-LM")
    p.add_argument("--grad-reduce", choices=["fp32", "bf16"], help="dtype of the data-parallel gradient reduction")
    p.add_argument("--batch-p2p", action=argparse.BooleanOptionalAction, default=None,
                   help="pipeline sends/receives as planned batches without tags (default: on with NCCL)")
    p.add_argument("--steps", type=int, help="steps to run now (default: up to max_steps)")
    p.add_argument("--save-dir", help="write a checkpoint here at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--load", help="resume from this checkpoint (any layout)")
    p.add_argument("--metrics-out", help="write per-step metrics as CSV (rank 0)")
    p.add_argument("--print-world-size", action="store_true",
                   help="print the number of ranks the config needs (tp*cp*pp*dp) and exit (batch scripts)")
    return p.parse_args(argv)


def build_config(args) -> TrainConfig:
    for flag in ("steps", "save_every"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise SystemExit(f"python -m mlmkit.train: --{flag.replace('_', '-')}={value} must be >= 0")
    cfg = TrainConfig.from_file(args.config) if args.config else demo_config()
    overrides = {}
    for field in ("tp", "pp", "dp", "cp", "ep", "expert_tp", "cp_split", "chunks", "micro_batch_size", "global_batch_size", "max_steps", "warmup_steps",
                  "microbatch_group",
                  "lr", "min_lr", "grad_clip", "weight_decay", "schedule", "zero", "zero1", "prefetch",
                  "reshard_after_forward", "sequence_parallel",
                  "batch_p2p", "precision", "grad_reduce"):
        value = getattr(args, field)
        if value is not None:
            overrides[field] = value
    if args.save_every and args.save_dir is None:        # it saved nothing
        raise SystemExit("python -m mlmkit.train: --save-every needs --save-dir (the folder to save into)")
    if args.recompute_granularity is not None and not args.recompute:
        raise SystemExit("python -m mlmkit.train: --recompute-granularity needs --recompute")
    if args.recompute:
        overrides["recompute"] = args.recompute_granularity or "full"
    if args.schedule is not None and args.chunks is None:
        # --schedule alone: the chunks it runs (zb-v and dualpipev: a V of 2; interleaved 1F1B: the
        # config's if it has several, else 2; the others: 1), not the config's for another schedule.
        if args.schedule in V_SCHEDULES:
            overrides["chunks"] = 2
        elif args.schedule == "interleaved-1f1b":
            overrides["chunks"] = cfg.chunks if cfg.chunks > 1 else 2
        elif args.schedule in SCHEDULES:
            overrides["chunks"] = 1
        elif is_schedule_file(args.schedule):
            chunks = _file_chunks(args.schedule)
            if chunks is not None:
                overrides["chunks"] = chunks
    model = {}
    if args.arch is not None:
        model.update(ARCHITECTURES[args.arch])
        if args.arch == "llama" and cfg.model.kv_heads is None and cfg.model.heads % 2 == 0:
            model["kv_heads"] = cfg.model.heads // 2          # grouped-query attention by default
    if args.kv_heads is not None:
        model["kv_heads"] = args.kv_heads
    for flag in MOE_FLAGS:
        if getattr(args, flag) is not None:
            model[flag] = getattr(args, flag)
    _check_top_1(args, cfg.model)
    if model:
        overrides["model"] = model
    # A batch job writes no traces: recording them would cost time on every collective and memory
    # that grows with every step (about 50 KB per rank and step for the quickstart model).
    overrides["tracing"] = False
    cfg = cfg.replace(**overrides)
    given = [_flag(flag, getattr(args, flag)) for flag in MOE_FLAGS[1:] if getattr(args, flag) is not None]
    if given and not cfg.model.moe:                     # they changed nothing
        raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a mixture of experts, and "
                         f"this model has none: add --experts N")
    return cfg


def _file_chunks(path: str):
    """The chunks per rank of a schedule file, or None when it cannot be read (the config then names why)."""
    from mlmkit.pipeline import from_torch

    try:
        return from_torch(path).chunks
    except (OSError, ValueError, csv.Error):
        return None


#: The mixture-of-experts flags, ``--experts`` first.
MOE_FLAGS = ("experts", "top_k", "moe_renormalize", "moe_aux_loss_coeff", "moe_capacity_factor")


def _flag(field: str, value) -> str:
    """The command-line spelling of ``field`` given as ``value`` (``--no-moe-renormalize`` for False)."""
    return f"--{'no-' if value is False else ''}{field.replace('_', '-')}"


def _check_top_1(args, model) -> None:
    """``--top-k 1`` with renormalised router weights gives every token weight 1 and the router no
    gradient from the loss: GPTConfig refuses it and names a config field, which a command line has
    not got; name the flag that fixes it."""
    top_k = args.top_k if args.top_k is not None else model.top_k
    renormalize = args.moe_renormalize if args.moe_renormalize is not None else model.moe_renormalize
    experts = args.experts if args.experts is not None else model.experts
    if experts and top_k == 1 and renormalize:
        said = "--top-k 1" if args.top_k is not None else "top_k=1 (the config's)"
        raise ValueError(top_1_refusal(said))


#: The blocks ``--arch`` selects (the sizes of the config are kept).
ARCHITECTURES = {
    "gpt": dict(norm="layernorm", mlp="gelu", position="learned", bias=True, tie_embeddings=True, kv_heads=None),
    "llama": dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False),
}


def _writable_folder(path: str) -> bool:
    """``path`` is a folder this process may create files in, or could be created as one: its
    nearest existing folder takes a new folder (tried, then removed). Permission bits alone said yes
    to root for ``/proc`` and read-only mounts, and the run failed at its end, when it saved."""
    import tempfile

    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mlmkit-probe-", dir=path))
    except OSError:
        return False
    return True


def check_paths(args, cfg: TrainConfig) -> None:
    """The files a run reads and writes, checked before any process group exists: a checkpoint to
    resume that is missing or of another model, or an output that cannot be written (found only
    after the whole run before), raise ValueError naming the flag."""
    for flag in ("load", "save_dir", "metrics_out"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            # "" passed every check below as the current folder, and --metrics-out '' failed to open
            # only after the whole run
            raise ValueError(f"--{flag.replace('_', '-')}={value!r} is empty: give a path")
    if args.load is not None:
        from mlmkit.train.checkpoint import CheckpointError, check_checkpoint, checkpoint_step

        try:
            check_checkpoint(args.load, cfg.model)
            step = checkpoint_step(args.load)
        except CheckpointError as err:
            raise ValueError(f"--load={args.load!r}: {err}") from None
        if args.steps is None and step >= cfg.max_steps:
            # "Up to max_steps" is then no step at all: the run would only save the checkpoint again.
            raise ValueError(f"--load={args.load!r} resumes at step {step}, and max_steps={cfg.max_steps}: nothing "
                             f"is left to train; pass --steps N for N more steps (past max_steps the learning rate "
                             f"stays at min_lr) or --max-steps above {step}")
    if args.save_dir is not None:
        if os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
            raise ValueError(f"--save-dir={args.save_dir!r} is a file: give a folder (created if missing)")
        if not _writable_folder(args.save_dir):
            raise ValueError(f"--save-dir={args.save_dir!r} cannot be created or written to: give a writable folder")
    if args.metrics_out is not None:
        if os.path.isdir(args.metrics_out):
            raise ValueError(f"--metrics-out={args.metrics_out!r} is a folder: give a file name (CSV)")
        parent = os.path.dirname(os.path.abspath(args.metrics_out))
        if not os.path.isdir(parent):
            raise ValueError(f"--metrics-out={args.metrics_out!r}: the folder {parent!r} does not exist")
        if not _writable_folder(parent) or (os.path.exists(args.metrics_out)
                                            and not os.access(args.metrics_out, os.W_OK)):
            raise ValueError(f"--metrics-out={args.metrics_out!r} cannot be written: give a writable file")


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        cfg = build_config(args)  # bad configs fail here, before any process group exists
        check_corpus(cfg.corpus, seq_len=cfg.model.seq_len)
        check_paths(args, cfg)
    except ValueError as err:
        raise SystemExit(f"python -m mlmkit.train: {err}") from None
    if args.print_world_size:
        print(cfg.topology.world_size)
        return 0
    # A rank that dies in C++ (an abort in a library, a segfault) prints every thread's Python stack
    # on stderr, which torchrun and Slurm keep; otherwise the job log says only "Signal 6".
    faulthandler.enable(all_threads=True)
    from mlmkit.distributed.rendezvous import job_env    # no torch: the check below comes first

    job = job_env()
    world, rank = job.world_size, job.rank
    try:
        cfg.topology.check_world_size(world)
    except ValueError as err:
        how = {"torchrun": "torchrun --nproc-per-node", "slurm": "sbatch/srun --ntasks"}.get(job.launcher)
        raise SystemExit(f"python -m mlmkit.train: {err}" + (
            f" (started by {job.launcher}: set {how} to {cfg.topology.world_size})" if how else
            f" (without torchrun or srun there is 1 process: run it as torchrun --nproc-per-node "
            f"{cfg.topology.world_size} -m mlmkit.train ..., or add --tp 1 --pp 1 --dp 1 --cp 1)")) from None
    single = job.launcher == "none" or world == 1 and job.master_addr is None
    if not single and (job.master_addr is None or job.master_port is None):
        raise SystemExit("python -m mlmkit.train: MASTER_ADDR and MASTER_PORT are not set; under Slurm the batch "
                         "script exports them (cluster/slurm_train.sbatch: python -m mlmkit.distributed.rendezvous)")
    import torch

    from mlmkit.distributed import ProcessGroups, default_device, init_distributed
    from mlmkit.distributed.host_memory import keep_freed_memory
    from mlmkit.distributed.launch import local_gpus
    from mlmkit.train.checkpoint import load_checkpoint, save_checkpoint
    from mlmkit.train.trainer import Trainer

    if single:            # one process: the GPU where CUDA exists, as every rank of a larger run
        groups = ProcessGroups.single(device=default_device(0))
    else:
        gpus = local_gpus()
        if 0 < gpus < job.local_world_size:       # NCCL: two ranks on one GPU fail in its set-up
            raise SystemExit(f"python -m mlmkit.train: {job.local_world_size} ranks on this node but {gpus} GPU(s): "
                             f"each rank takes a GPU of its own; start at most {gpus} per node (torchrun "
                             f"--nproc-per-node {gpus}, or srun --ntasks-per-node {gpus})")
        if job.launcher == "torchrun":
            init_distributed(rank=rank, world_size=world, init_method="env://")
        else:     # srun: mlmkit's own store, bound to the master address only
            os.environ.setdefault("LOCAL_RANK", str(job.local_rank))
            init_distributed(rank=rank, world_size=world, init_method=f"tcp://{job.master_addr}:{job.master_port}")
        if not torch.cuda.is_available():
            torch.set_num_threads(job.cpus_per_task or max(1, (os.cpu_count() or 1) // job.local_world_size))
            keep_freed_memory()
        groups = ProcessGroups.build(cfg.topology)
    trainer = Trainer(cfg, groups=groups)
    if args.load:
        load_checkpoint(trainer, args.load)
    steps = args.steps if args.steps is not None else cfg.max_steps - trainer.step
    if rank == 0:
        m = cfg.model
        print(f"mlmkit.train: {cfg.topology!r}, schedule={cfg.schedule}, microbatches={cfg.microbatches}, "
              f"{m.norm}/{m.mlp}/{m.position}, heads={m.heads} kv_heads={m.num_kv_heads}, precision={cfg.precision}, "
              f"recompute={cfg.recompute}, " + (f"zero={cfg.zero}, " if cfg.zero else "")
              + (f"experts={m.experts} top_k={m.top_k}, " if m.moe else "")
              + f"steps {trainer.step}..{trainer.step + steps - 1}, device={groups.device}", flush=True)
    for _ in range(steps):
        row = trainer.train_step()
        if rank == 0:
            print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.save_dir and args.save_every and trainer.step % args.save_every == 0:
            save_checkpoint(trainer, args.save_dir)
    if args.save_dir:
        path = save_checkpoint(trainer, args.save_dir)
        if rank == 0:
            print(f"checkpoint: {path}", flush=True)
    if rank == 0 and args.metrics_out:
        trainer.metrics().to_csv(args.metrics_out, index=False)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()          # nobody closes its connections while a peer still reads
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The job is done and its process group destroyed. Leave without the interpreter's teardown,
    # as multiprocessing's children (run_ranks) do: tearing down torch's C++ objects with the
    # interpreter, gloo's threads can abort a finished rank ("terminate called without an active
    # exception", seen once in a 2-rank torchrun job), and torchrun then reports the job failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
