"""ZeRO-3 against PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per layer and
the root), same model, same data, dp=2 on CPU/gloo (one thread per rank).

mlmkit: ``Trainer`` with ``zero=3`` (tracing off): each layer all-gathered before its forward and
before its backward, freed after; each layer's gradient reduce-scattered after its backward; AdamW
on the fp32 shards. Baseline: the same model (mlmkit's serial :class:`~mlmkit.model.GPT`, the same
module code, so only the sharding differs) with ``fully_shard`` on every layer and on the model,
and ``torch.optim.AdamW`` on its sharded parameters. Both: fp32, no gradient clipping, one
microbatch per rank and step, the same samples (the first losses are checked equal); both
compute the global gradient norm and the mean loss over the ranks, as the trainer reports them.

Step time: whole optimizer steps, the two sides alternating step by step on the same two ranks
(median of per-step ratios). Peak memory: the rise of each rank's resident set over one step
(``VmHWM`` reset through ``/proc/self/clear_refs``), above what the process held before the model
was built, each side alone in fresh processes, with glibc returning every block over 64 KiB to the
system at once (glibc's ``mallopt(M_MMAP_THRESHOLD)``) so that the resident set follows live memory.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Row, median, paired
from mlmkit.distributed import run_ranks
from mlmkit.model import GPTConfig

MODEL = GPTConfig(vocab_size=256, seq_len=128, hidden=384, heads=6, layers=4)
MBS = 4


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _config():
    """mlmkit's side: ZeRO-3 over dp=2, fp32, no clipping, tracing off."""
    from mlmkit.train import TrainConfig

    return TrainConfig(model=MODEL, dp=2, zero=3, micro_batch_size=MBS, global_batch_size=2 * MBS, grad_clip=0.0,
                       tracing=False, lr=1e-3, warmup_steps=0, max_steps=1000)


def _fsdp2_model():
    """mlmkit's serial GPT (same seed, so the same weights as the trainer's) under FSDP2."""
    from torch.distributed.fsdp import fully_shard

    from mlmkit.model import GPT

    torch.manual_seed(0)
    model = GPT(MODEL)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    return model


def _run(rank, world_size, reps):
    import gc

    import torch.distributed as dist

    from mlmkit import Topology
    from mlmkit.distributed import ProcessGroups
    from mlmkit.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = _config()
    groups = ProcessGroups.build(Topology(dp=2))
    trainer = Trainer(cfg, groups=groups)

    plain = _fsdp2_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    step = [0]

    def ours() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        return _max(time.perf_counter() - t0)

    def theirs() -> float:
        tokens, targets = trainer.data.batch(step[0], cfg.global_batch_size)
        step[0] += 1
        mine = slice(rank * MBS, (rank + 1) * MBS)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = plain(tokens[mine], targets[mine])
        loss.backward()
        # what the trainer reports too: the global gradient norm and the mean loss
        torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
        dist.all_reduce(loss.detach().reshape(1).double())
        opt.step()
        return _max(time.perf_counter() - t0)

    def _max(t: float) -> float:
        x = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x)

    first = (trainer.train_step()["loss"], None)
    tokens, targets = trainer.data.batch(0, cfg.global_batch_size)
    # (the first losses agree: same weights, same samples; checked once)
    a, b = [], []
    for _ in range(2):
        ours(), theirs()
    for i in range(reps):
        if i % 2:
            a.append(ours()); b.append(theirs())
        else:
            b.append(theirs()); a.append(ours())
    del first, tokens, targets
    return a, b


def _memory(rank, world_size, side):
    """One side alone in fresh processes: the rise of the resident set over a step (after two
    warm-up steps, so optimizer state exists) above the process before the model was built."""
    import gc

    import torch.distributed as dist

    from mlmkit import Topology
    from mlmkit.distributed import ProcessGroups
    from mlmkit.train.data import TextData
    from mlmkit.train.trainer import Trainer

    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD: big blocks go back at once
    torch.set_num_threads(1)
    cfg = _config()
    groups = ProcessGroups.build(Topology(dp=2))
    data = TextData(seq_len=MODEL.seq_len)
    tokens, targets = data.batch(0, cfg.global_batch_size)
    dist.barrier()
    gc.collect()
    base = _rss_kib("VmRSS")
    if side == "mlmkit":
        trainer = Trainer(cfg, groups=groups)
        step = trainer.train_step
    else:
        plain = _fsdp2_model()
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        mine = slice(rank * MBS, (rank + 1) * MBS)

        def step():
            opt.zero_grad(set_to_none=True)
            plain(tokens[mine], targets[mine]).backward()
            opt.step()
    for _ in range(2):
        step()
    gc.collect()
    if not _reset_peak():
        return float("nan")
    step()
    return (_rss_kib("VmHWM") - base) * 1024


def _check_losses(rank, world_size):
    # Same weights and data: mlmkit's ZeRO-3 and FSDP2's first loss agree.
    import torch.distributed as dist

    from mlmkit import Topology
    from mlmkit.distributed import ProcessGroups
    from mlmkit.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = _config()
    trainer = Trainer(cfg, groups=ProcessGroups.build(Topology(dp=2)))
    plain = _fsdp2_model()
    tokens, targets = trainer.data.batch(0, cfg.global_batch_size)
    mine = slice(rank * MBS, (rank + 1) * MBS)
    theirs = plain(tokens[mine], targets[mine]).detach().reshape(1).double()
    dist.all_reduce(theirs)
    ours = trainer.train_step()["loss"]
    return ours, float(theirs) / 2


def run(quick: bool = False) -> list[Row]:
    reps = 6 if quick else 16
    ours, theirs = run_ranks(_check_losses, world_size=2, timeout_s=600)[0]
    assert abs(ours - theirs) <= 1e-4 * abs(theirs), (ours, theirs)
    a, b = run_ranks(_run, world_size=2, args=(reps,), timeout_s=900)[0]
    peaks = {side: run_ranks(_memory, world_size=2, args=(side,), timeout_s=600) for side in ("mlmkit", "fsdp2")}
    m_ours, m_theirs, ratio = paired(a, b)
    case = f"GPT h={MODEL.hidden} L={MODEL.layers} s={MODEL.seq_len} b={MBS}, dp=2, fp32, whole steps"
    rows = [Row("ZeRO-3 step vs FSDP2 (fully_shard per layer)", case, m_ours * 1e3, m_theirs * 1e3, "ms",
                "<= 1.0", ratio <= 1.0, ratio=ratio, note="alternating steps; median of per-step ratios")]
    for rank in range(2):
        ours_b, theirs_b = peaks["mlmkit"][rank], peaks["fsdp2"][rank]
        ok = abs(ours_b / theirs_b - 1) <= 0.10 if theirs_b == theirs_b else None
        rows.append(Row(f"ZeRO-3 peak memory vs FSDP2, rank {rank}", "resident-set peak during a step above the "
                        "process before the model (each side alone)", ours_b / 2**20, theirs_b / 2**20, "MiB",
                        "within 10%", ok, note="VmHWM reset by /proc/self/clear_refs"))
    return rows
