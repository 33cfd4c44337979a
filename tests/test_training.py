"""3D training against a plain-PyTorch serial run; checkpoints that reshard and survive crashes; torchrun."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from mlmkit.distributed import ProcessGroups, RankFailure, run_ranks
from mlmkit.model import GPT, GPTConfig
from mlmkit.train import TrainConfig
from mlmkit.train.config import check_corpus, demo_config
from mlmkit.train.checkpoint import CheckpointError, export_state_dict, load_checkpoint, save_checkpoint
from mlmkit.train.data import TextData
from mlmkit.train.lr import lr_at
from mlmkit.train.trainer import Trainer

MODEL = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4)
BASE = TrainConfig(model=MODEL, micro_batch_size=2, global_batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                   max_steps=5, grad_clip=0.5, weight_decay=0.01)
RTOL = 1e-5


class MaskedData:
    """The trainer's data with some targets ignored (-100), unevenly over the samples of a batch, as
    padding or document masking do: the per-token loss must still equal the serial model's."""

    def __init__(self, data):
        self.data = data

    def batch(self, step, batch_size):
        tokens, targets = self.data.batch(step, batch_size)
        g = torch.Generator().manual_seed(1000 + step)
        keep = torch.rand(targets.shape, generator=g) < torch.linspace(0.3, 1.0, batch_size)[:, None]
        keep[:, 0] = True
        return tokens, targets.masked_fill(~keep, -100)


def serial_losses(cfg: TrainConfig, steps: int) -> list[float]:
    """The reference: plain PyTorch on one process (GPT at tp=1, torch's AdamW and clip_grad_norm_)."""
    return serial_metrics(cfg, steps)[0]


def serial_metrics(cfg: TrainConfig, steps: int) -> tuple[list[float], list[float]]:
    """The reference's losses and gradient norms (before clipping, as torch's clip_grad_norm_ returns)."""
    model = GPT(cfg.model)
    # Megatron-LM's parameter groups: no weight decay on biases and one-dimensional weights (norm gains)
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=0.0, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps)
    data = MaskedData(TextData(seq_len=cfg.model.seq_len, seed=cfg.seed))
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = data.batch(step, cfg.global_batch_size)
        opt.zero_grad()
        loss = model(tokens, targets)            # mean over every non-ignored token of the batch
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps)
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _trainer(cfg, groups):
    trainer = Trainer(cfg, groups=groups)
    trainer.data = MaskedData(trainer.data)
    return trainer


@pytest.fixture(scope="module")
def reference():
    return serial_losses(BASE, 5)


def _train_save_resume(rank, world_size, cfg_dict, directory):
    """5 steps with a checkpoint after step 3, then a fresh trainer resumed from it for steps 3-4."""
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology)
    trainer = _trainer(cfg, groups)
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    save_checkpoint(trainer, directory)
    losses += [trainer.train_step()["loss"] for _ in range(2)]
    resumed = _trainer(cfg, groups)
    assert load_checkpoint(resumed, directory) == 3
    return losses, [resumed.train_step()["loss"] for _ in range(2)]


def _close(got, want, tol=RTOL):
    return all(abs(a - b) <= tol * abs(b) for a, b in zip(got, want)) and len(got) == len(want)


LAYOUTS = [(2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1)]


@pytest.mark.parametrize("zero1", [False, True], ids=["adamw", "zero1"])
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_3d_training_matches_serial_and_resumes(reference, tp, pp, dp, zero1, tmp_path):
    # Ignored targets in every batch: the per-token loss equals the serial model's in every layout.
    cfg = BASE.replace(tp=tp, pp=pp, dp=dp, zero1=zero1)
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_train_save_resume, world_size=cfg.world_size, args=(cfg.to_dict(), directory), timeout_s=300)
    for losses, resumed in results:
        assert _close(losses, reference), (losses, reference)
        # Resume in the same layout continues exactly (ZeRO-1's fp32 shard follows the loaded weights).
        assert _close(resumed, losses[3:], 1e-6), (resumed, losses[3:])
    assert reference[-1] < reference[0]
    # ... and in another layout: serial, with the other optimizer.
    serial = _trainer(BASE.replace(zero1=not zero1), ProcessGroups.single())
    assert load_checkpoint(serial, directory) == 3
    assert _close([serial.train_step()["loss"] for _ in range(2)], results[0][0][3:], 1e-6)


def test_recompute_sequence_parallel_interleaved(reference):
    cfg = BASE.replace(tp=2, pp=2, dp=2, recompute=True, sequence_parallel=True, schedule="interleaved-1f1b",
                       chunks=2, zero1=True, batch_p2p=True)
    results = run_ranks(_train, world_size=8, args=(cfg.to_dict(), 5), timeout_s=300)
    assert _close(results[0], reference)


@pytest.mark.parametrize("layout", [
    # the split backward (I and W), sequence parallelism: the tp ranks' own dropout streams
    dict(tp=2, pp=2, sequence_parallel=True, schedule="zb-h1"),
    # ZeRO-3: the parameters gathered again for the recomputation; interleaved chunks
    dict(pp=2, dp=2, zero=3, schedule="interleaved-1f1b", chunks=2),
], ids=["tp2-sp-pp2-zbh1", "pp2-dp2-zero3-interleaved"])
def test_recomputation_replays_the_dropout_masks(layout):
    # With dropout a layout cannot equal the serial run (each draws its own masks, as Megatron-LM's
    # ranks do), but a recomputed layer must draw the masks its forward drew, or the backward
    # differentiates another network and nothing says so: losses and gradient norms (clipping on)
    # the same with no, selective and full recomputation.
    cfg = BASE.replace(model=dataclasses.replace(MODEL, dropout=0.1), **layout)
    runs = {rc: run_ranks(_train_metrics, world_size=cfg.world_size, args=(cfg.replace(recompute=rc).to_dict(), 3),
                          timeout_s=300)[0] for rc in ("none", "selective", "full")}
    for rc in ("selective", "full"):
        assert all(_close(got, want, 1e-6) for got, want in zip(runs[rc], runs["none"])), (rc, runs)
    without = run_ranks(_train_metrics, world_size=cfg.world_size, args=(BASE.replace(**layout).to_dict(), 3),
                        timeout_s=300)[0]
    assert without[0][0] != runs["none"][0][0]            # the masks were drawn


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, sequence_parallel=True), dict(dp=2, zero=3, recompute="full")],
                         ids=["tp2-sp-pp2", "dp2-zero3-full"])
def test_resuming_with_dropout_draws_the_masks_the_run_would_have(layout, tmp_path):
    # The checkpoint holds every rank's random streams (the tp ranks' own and the replicated one):
    # resumed in the same layout, the next steps draw the masks the uninterrupted run drew.
    cfg = BASE.replace(model=dataclasses.replace(MODEL, dropout=0.1), **layout)
    results = run_ranks(_train_save_resume, world_size=cfg.world_size, args=(cfg.to_dict(), str(tmp_path / "ckpt")),
                        timeout_s=300)
    for losses, resumed in results:
        assert resumed == losses[3:], (resumed, losses)


def _dropout_masks_of_one_step(rank, world_size, cfg_dict):
    """Every dropout mask this rank drew in one training step, in order (``[...]`` bools, True = dropped)."""
    import mlmkit.model.blocks as blocks
    import mlmkit.model.gpt as gpt
    import mlmkit.moe.layer as moe_layer
    from mlmkit.tensor_parallel.random import dropout

    masks = []

    def recording(x, p, *, generator, training):
        out = dropout(x, p, generator=generator, training=training)
        if training and p > 0:
            masks.append((out == 0).flatten())
        return out

    for module in (blocks, gpt, moe_layer):
        module.dropout = recording
    try:
        cfg = TrainConfig.from_dict(cfg_dict)
        trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single())
        with torch.no_grad(), trainer.full_parameters():
            for chunk in trainer.chunks:            # no zero to drop: a dropped element reads 0
                for param in chunk.parameters():
                    param.add_(1e-3)
        trainer.train_step()
    finally:
        for module in (blocks, gpt, moe_layer):
            module.dropout = dropout
    return masks


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, schedule="interleaved-1f1b", chunks=2),
                                    dict(pp=2, schedule="zb-v", chunks=2), dict(pp=1, schedule="dualpipev", chunks=2)],
                         ids=["pp2-1f1b", "pp2-interleaved", "pp2-zbv", "pp1-dualpipev"])
def test_model_chunks_on_one_rank_draw_their_own_dropout_masks(layout):
    # Each model chunk holds its own random streams; seeded by the pipeline rank alone, the chunks of
    # one rank drew the same sequence of masks, so two layers of different chunks dropped the same
    # elements for every microbatch (a correlation no single-stream run has, and nothing said so).
    cfg = BASE.replace(model=dataclasses.replace(MODEL, dropout=0.1, layers=8), micro_batch_size=2, global_batch_size=8,
                       **layout)
    for rank, masks in enumerate(run_ranks(_dropout_masks_of_one_step, world_size=cfg.world_size,
                                           args=(cfg.to_dict(),), timeout_s=300)):
        assert len(masks) > 8
        seen = {}
        for i, mask in enumerate(masks):
            key = (mask.numel(), hash(mask.numpy().tobytes()))
            assert key not in seen, f"rank {rank}: dropout draws {seen[key]} and {i} dropped the same elements"
            seen[key] = i


def test_a_checkpoint_whose_chunks_share_one_stream_does_not_bring_the_repeat_back(tmp_path):
    # Checkpoints written before each model chunk had its own dropout streams hold one state for every
    # chunk of a rank; resumed as they are, the chunks would drop the same elements again.
    cfg = BASE.replace(model=dataclasses.replace(MODEL, dropout=0.1), schedule="interleaved-1f1b", chunks=2,
                       micro_batch_size=1, global_batch_size=8)
    old = Trainer(cfg, groups=ProcessGroups.single())
    old.train_step()
    old.chunks[1].rng.set_state(old.chunks[0].rng.get_state())          # as the old seeding left them
    save_checkpoint(old, str(tmp_path))
    resumed = Trainer(cfg, groups=ProcessGroups.single())
    assert load_checkpoint(resumed, str(tmp_path)) == 1
    first, second = (c.rng.get_state() for c in resumed.chunks)
    assert all(torch.equal(a, b) for a, b in zip(first, old.chunks[0].rng.get_state()))    # restored
    assert not any(torch.equal(a, b) for a, b in zip(first, second))                      # not repeated
    # A checkpoint of the current seeding restores every chunk's own streams.
    current = Trainer(cfg, groups=ProcessGroups.single())
    current.train_step()
    save_checkpoint(current, str(tmp_path / "current"))
    again = Trainer(cfg, groups=ProcessGroups.single())
    load_checkpoint(again, str(tmp_path / "current"))
    for mine, theirs in zip(again.chunks, current.chunks):
        assert all(torch.equal(a, b) for a, b in zip(mine.rng.get_state(), theirs.rng.get_state()))


def _train(rank, world_size, cfg_dict, steps):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = _trainer(cfg, ProcessGroups.build(cfg.topology))
    return [trainer.train_step()["loss"] for _ in range(steps)]


def _train_metrics(rank, world_size, cfg_dict, steps):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = _trainer(cfg, ProcessGroups.build(cfg.topology))
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v", "dualpipev"])
def test_every_chunk_on_one_pipeline_rank_matches_serial(schedule):
    # pp=1 with two model chunks: the first chunk embeds, the second holds the head's copy of the tied
    # word embedding on the same rank. The copy's gradient is the embedding's (summed locally), so it
    # must not count again in the gradient norm: counted twice, the norm came out 3.398 instead of
    # 3.289 and clipping scaled every gradient wrongly.
    cfg = BASE.replace(pp=1, dp=2, chunks=2, schedule=schedule)
    losses, norms = serial_metrics(cfg, 3)
    for got in run_ranks(_train_metrics, world_size=2, args=(cfg.to_dict(), 3), timeout_s=300):
        assert _close([n for _, n in got], norms), (got, norms)
        assert _close([l for l, _ in got], losses), (got, losses)
    assert min(norms) > cfg.grad_clip            # clipping acts on every step


def _tied_copies_after_steps(rank, world_size, cfg_dict, steps):
    """This rank's copies of the tied word embedding (first chunk's, last chunk's) after ``steps``,
    with its coordinates, and the traced bytes of the last step."""
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology)
    trainer = _trainer(cfg, groups)
    for _ in range(steps):
        trainer.clear_traces()
        trainer.train_step()
    c = groups.coords
    traces = trainer.traces()
    with trainer.full_parameters():                  # ZeRO-3: gathered from the shards
        copies = [p.detach().clone() for model in trainer.chunks for p in model.vocab_parameters()]
    return {"key": (c.tp, c.cp, c.dp), "pp": c.pp, "comm": traces["comm"], "memory": traces["memory"],
            "copies": copies}


@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("layout", [dict(pp=2, dp=2, cp=2), dict(pp=1, dp=2, cp=2, chunks=2,
                                                                  schedule="interleaved-1f1b")],
                         ids=["pp2-dp2-cp2", "pp1-v2-dp2-cp2"])
def test_the_tied_embedding_copies_stay_equal_to_the_bit(layout, zero):
    # The first stage's word embedding and the last stage's copy get the same summed gradient, then
    # the data-parallel reduction. With four replicas the ring adds an element's four parts in an
    # order that depends on its place in the bucket (ZeRO-1: in the flat vector), and the two copies
    # sat at different places: they parted by float rounding (1e-8 after one step, 3e-8 after 40).
    # Each now has a bucket (ZeRO-1: a shard; ZeRO-2/3: a unit) of its own, as Megatron-LM gives it,
    # reduced alike on both stages; the estimators count its bytes so.
    from mlmkit.estimate import estimate_train_comm, estimate_train_memory
    from mlmkit.estimate.compare import compare_comm, compare_memory
    from mlmkit.trace.export import merge_traces

    cfg = BASE.replace(zero=zero, **layout)       # one bucket holds every gradient but the copy
    out = run_ranks(_tied_copies_after_steps, world_size=cfg.world_size, args=(cfg.to_dict(), 3), timeout_s=300)
    pairs = 0
    for r in out:
        if len(r["copies"]) == 2:                                   # both ends on this rank
            assert torch.equal(*r["copies"]), r["key"]
            pairs += 1
        elif r["pp"] == 0:                                          # the other end: the last stage, same place
            other = next(o for o in out if o["key"] == r["key"] and o["pp"] == cfg.pp - 1)
            assert torch.equal(r["copies"][0], other["copies"][0]), r["key"]
            pairs += 1
    assert pairs == cfg.world_size // cfg.pp
    traces = merge_traces({"comm": r["comm"], "memory": r["memory"]} for r in out)
    table = compare_comm(traces["comm"], estimate_train_comm(cfg))
    assert (table.measured == table.estimated).all(), table[table.measured != table.estimated]
    table = compare_memory(traces["memory"], estimate_train_memory(cfg))
    assert (table.measured == table.estimated).all(), table[table.measured != table.estimated]


def test_no_clipping_with_grad_clip_zero():
    cfg = BASE.replace(grad_clip=0.0)
    trainer = _trainer(cfg, ProcessGroups.single())
    got = [trainer.train_step()["loss"] for _ in range(3)]
    assert _close(got, serial_losses(cfg, 3))
    assert trainer.history[0]["grad_norm"] > 0     # the norm is still reported


# ----------------------------------------------------------------------------------- checkpoints
def _save_at_3_then_continue(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(trainer, directory)
    return [trainer.train_step()["loss"] for _ in range(2)]


def _resume(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    assert load_checkpoint(trainer, directory) == 3
    return [trainer.train_step()["loss"] for _ in range(2)]


def test_checkpoint_reshards_to_other_layouts(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = BASE.replace(tp=2, pp=2, dp=1, zero1=True)
    uninterrupted = run_ranks(_save_at_3_then_continue, world_size=4, args=(saved.to_dict(), directory))[0]
    assert open(os.path.join(directory, "latest")).read() == "step_000003"
    # (1, 1, 1): in this very process, no torch.distributed at all.
    serial = Trainer(BASE.replace(zero1=True), groups=ProcessGroups.single())
    assert load_checkpoint(serial, directory) == 3
    resumed_serial = [serial.train_step()["loss"] for _ in range(2)]
    resumed_122 = run_ranks(_resume, world_size=4, args=(BASE.replace(pp=2, dp=2, zero1=True).to_dict(), directory))[0]
    for resumed in (resumed_serial, resumed_122):
        assert _close(resumed, uninterrupted, 1e-6), (resumed, uninterrupted)
    # The same through the command line: --load with --zero1 after resharding to one process.
    config = tmp_path / "run.json"
    BASE.save(str(config))
    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config), "--zero1", "--load",
                          directory, "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    cli = [json.loads(line)["loss"] for line in out.stdout.splitlines() if line.startswith("{")]
    assert _close(cli, uninterrupted, 1e-6), (cli, uninterrupted)
    # Exported as one state dict, the checkpoint is the serial model at step 3: the weights a
    # trainer resumed from it holds, every one of them.
    state = export_state_dict(directory)
    model = GPT(BASE.model)
    model.load_state_dict(state)
    at_3 = Trainer(BASE.replace(zero1=True), groups=ProcessGroups.single())
    load_checkpoint(at_3, directory)
    named = dict(at_3.named_parameters())
    assert set(named) == set(state)
    for name, p in named.items():
        assert torch.equal(state[name], p.detach()), name
    assert not torch.equal(state["embedding.weight"], GPT(BASE.model).embedding.weight.detach())


# V placement (zb-v, dualpipev: rank 0 holds the first and the last virtual stage), loop placement
# with chunks, and sharded optimizer states: each checkpoint resumes in one process and at pp=4 x 1f1b.
V_SOURCES = {
    "pp2-dualpipev": dict(pp=2, schedule="dualpipev", chunks=2),
    "zero3-dp2-pp2-zbv": dict(zero=3, dp=2, pp=2, schedule="zb-v", chunks=2),
    "cp2-pp2-interleaved-zero1": dict(cp=2, pp=2, schedule="interleaved-1f1b", chunks=2, zero1=True),
}


@pytest.mark.parametrize("source", list(V_SOURCES))
def test_checkpoint_of_chunked_pipelines_reshards(source, tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = BASE.replace(**V_SOURCES[source])
    uninterrupted = run_ranks(_save_at_3_then_continue, world_size=saved.world_size,
                              args=(saved.to_dict(), directory))[0]
    sharded = {"zero1": saved.zero1, "zero": saved.zero}
    serial = Trainer(BASE.replace(**sharded), groups=ProcessGroups.single())
    assert load_checkpoint(serial, directory) == 3
    resumed_serial = [serial.train_step()["loss"] for _ in range(2)]
    resumed_pp4 = run_ranks(_resume, world_size=4, args=(BASE.replace(pp=4, **sharded).to_dict(), directory))[0]
    for resumed in (resumed_serial, resumed_pp4):
        assert _close(resumed, uninterrupted, 1e-5), (source, resumed, uninterrupted)


def _live_bytes_after_steps(rank, world_size, cfg_dict, steps):
    import gc

    from live_bytes import LiveBytes

    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    trainer.train_step()                          # optimizer state and buffers exist from here on
    live, after = LiveBytes(), []
    with live:
        for _ in range(steps):
            trainer.train_step()
            gc.collect()
            after.append(live.bytes)
    return after


# Sharded optimizer states with split backward, experts through a V schedule, context parallelism
# with tp in bf16: whatever a step allocates is freed by the next one.
NO_LEAK = {
    "zero3-dp2-pp2-zbv": dict(zero=3, dp=2, pp=2, schedule="zb-v", chunks=2),
    "moe-ep2-dp2-pp2-dualpipev": dict(model=dict(experts=4, top_k=2, moe_ffn_hidden=32), ep=2, dp=2, pp=2,
                                      schedule="dualpipev", chunks=2, global_batch_size=16),
    "cp2-tp2-sp-bf16-full": dict(cp=2, tp=2, sequence_parallel=True, precision="bf16", recompute="full"),
}


@pytest.mark.parametrize("layout", list(NO_LEAK))
def test_steps_allocate_nothing_that_outlives_them(layout):
    # Every tensor storage alive on each rank (tests/live_bytes.py, independent of mlmkit's own
    # accounting) after steps 2 to 5: the same within 1 KiB, a quarter of one activation [s, b, h]
    # here (what a step keeps of its routing can differ by a few bytes with the data: 16 once).
    cfg = BASE.replace(**NO_LEAK[layout])
    activation = cfg.model.seq_len * cfg.micro_batch_size * cfg.model.hidden * 4
    per_rank = run_ranks(_live_bytes_after_steps, world_size=cfg.world_size, args=(cfg.to_dict(), 4), timeout_s=300)
    for rank, after in enumerate(per_rank):
        assert max(after) - min(after) <= activation // 4, (layout, rank, after)


def _crash_between_shards(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    trainer.train_step()
    save_checkpoint(trainer, directory)          # step 1: complete
    trainer.train_step()

    def crash(path):
        if path.endswith("shard_tp1_pp0.pt"):
            time.sleep(0.5)                      # let rank 0 write its shard first
            os._exit(3)                          # then die before writing ours
    save_checkpoint(trainer, directory, _before_write=crash)


def test_crash_between_shard_writes_keeps_previous_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    cfg = BASE.replace(tp=2)
    with pytest.raises(RankFailure) as info:
        run_ranks(_crash_between_shards, world_size=2, args=(cfg.to_dict(), directory), timeout_s=120)
    assert info.value.rank == 1
    assert os.path.exists(os.path.join(directory, ".step_000002.tmp", "shard_tp0_pp0.pt"))  # the half-written one
    assert open(os.path.join(directory, "latest")).read() == "step_000001"
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    assert load_checkpoint(trainer, directory) == 1


def _mid_step_checkpoints(rank, world_size, cfg_dict, directory):
    # At every point of a step (the ranks' positions after each of the step's actions in a lockstep
    # order that never blocks, the last one all actions done before the optimizer): saving and
    # loading are refused on every rank, before any collective (no rank waits for the others),
    # without writing and without touching the trainer, which then finishes the step.
    from mlmkit.pipeline.cursor import ScheduleCursor

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology)
    trainer = Trainer(cfg, groups=groups)
    trainer.train_step()
    save_checkpoint(trainer, directory)
    cursor = ScheduleCursor(trainer.schedule)
    prefixes = [list(cursor.index)]
    while cursor.runnable():
        cursor.advance(cursor.runnable()[0])
        prefixes.append(list(cursor.index))
    refused = []
    for prefix in prefixes:
        trainer.begin_step()
        for _ in range(prefix[groups.coords.pp]):
            trainer.executor.step_action()
        for call in (lambda: save_checkpoint(trainer, directory), lambda: load_checkpoint(trainer, directory)):
            try:
                call()
            except RuntimeError as err:
                refused.append(str(err))
        while not trainer.executor.done:
            trainer.executor.step_action()
        trainer.finish_step()
    assert sorted(os.listdir(directory)) == ["latest", "step_000001"]
    reference = Trainer(cfg, groups=groups)
    losses = [reference.train_step()["loss"] for _ in range(len(prefixes) + 1)]
    return {"prefixes": [p[groups.coords.pp] for p in prefixes], "actions": len(trainer.executor.actions),
            "refused": refused, "losses": [h["loss"] for h in trainer.history], "reference": losses}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_step_in_progress_is_neither_saved_nor_loaded_into(schedule, tmp_path):
    cfg = BASE.replace(pp=2, schedule=schedule, chunks=2 if schedule == "zb-v" else 1, global_batch_size=8,
                       max_steps=200, model={"dropout": 0.1})
    results = run_ranks(_mid_step_checkpoints, world_size=2, args=(cfg.to_dict(), str(tmp_path / "ck")),
                        timeout_s=120)
    for rank, r in enumerate(results):
        n = r["actions"]
        assert len(r["refused"]) == 2 * len(r["prefixes"]) and r["prefixes"][-1] == n
        for step, (done, save, load) in enumerate(zip(r["prefixes"], r["refused"][::2], r["refused"][1::2]), 1):
            where = f"action {done} of {n} done" if done < n else "its actions done, the optimizer step not yet taken"
            assert save.startswith(f"save_checkpoint: step {step} is in progress on rank {rank} ({where})"), save
            assert "dropout masks" in save and "trainer.abandon_step()" in save
            assert load.startswith(f"load_checkpoint: step {step} is in progress on rank {rank} ({where})"), load
        if r["losses"][0] is not None:                     # the last stage's rank: refused calls changed nothing
            assert r["losses"] == r["reference"]


def test_a_dropped_step_saves_and_resumes_as_if_never_begun(tmp_path):
    # A step begun and dropped after any number of its actions: saved then, the checkpoint resumes
    # into the run that never began it (the dropout masks of the step drawn again alike).
    cfg = BASE.replace(model={"dropout": 0.1}, max_steps=50)
    reference = Trainer(cfg, groups=ProcessGroups.single())
    expected = [reference.train_step()["loss"] for _ in range(2)]
    trainer = Trainer(cfg, groups=ProcessGroups.single())
    trainer.train_step()
    n = len(trainer.executor.actions)
    for done in range(n + 1):
        trainer.begin_step()
        for _ in range(done):
            trainer.executor.step_action()
        with pytest.raises(RuntimeError, match="in progress"):
            save_checkpoint(trainer, str(tmp_path / f"ck{done}"))
        trainer.abandon_step()
        save_checkpoint(trainer, str(tmp_path / f"ck{done}"))
        resumed = Trainer(cfg, groups=ProcessGroups.single())
        assert load_checkpoint(resumed, str(tmp_path / f"ck{done}")) == 1
        assert resumed.train_step()["loss"] == expected[1], done


def test_a_step_is_begun_once_and_finished_once():
    # Begun again half-way, a step would be dropped after its dropout masks were drawn (the run then
    # differs from the uninterrupted one); finished twice, the optimizer would step again on the
    # same gradients. Both are refused at every point, and the run goes on exactly.
    cfg = BASE.replace(model={"dropout": 0.1}, max_steps=50)
    reference = Trainer(cfg, groups=ProcessGroups.single())
    expected = [reference.train_step()["loss"] for _ in range(3)]
    trainer = Trainer(cfg, groups=ProcessGroups.single())
    with pytest.raises(RuntimeError, match=r"finish_step: no step in progress on rank 0 \(step 0 has not begun"):
        trainer.finish_step()                               # a new trainer: no gradients to apply
    n = len(trainer.executor.actions)
    trainer.begin_step()
    for done in range(n + 1):
        where = f"action {done} of {n} done" if done < n else "its actions done"
        for call in (trainer.begin_step, trainer.train_step):
            with pytest.raises(RuntimeError, match=rf"begin_step: step 0 is already in progress on rank 0 \({where}\)"):
                call()
        if done < n:
            trainer.executor.step_action()
    assert trainer.finish_step()["loss"] == expected[0]
    with pytest.raises(RuntimeError, match=r"finish_step: no step in progress on rank 0 \(step 1 has not begun; the "
                                           r"one before is finished\)"):
        trainer.finish_step()
    assert [trainer.train_step()["loss"] for _ in range(2)] == expected[1:]


def test_resuming_restores_torch_global_random_state(tmp_path):
    # Code around a run (a notebook's own noise, a user's sampler) draws from torch's global
    # generator. A trainer seeds it when built, so only draws made between building and saving
    # tell whether the checkpoint's state is restored: the resumed session draws what the
    # uninterrupted one would have.
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    trainer.train_step()
    torch.rand(3)                                   # the user's draws after the trainer was built
    path = save_checkpoint(trainer, str(tmp_path / "ck"))
    expected = torch.rand(4)
    resumed = Trainer(BASE, groups=ProcessGroups.single())      # seeds the generator again
    assert not torch.equal(torch.rand(4), expected)             # so the test can fail
    resumed = Trainer(BASE, groups=ProcessGroups.single())
    load_checkpoint(resumed, path)
    assert torch.equal(torch.rand(4), expected)


def test_torn_weights_are_not_saved_and_loading_mends_them(tmp_path):
    # A failure while the optimizer changes the weights leaves them torn: saving them is refused;
    # loading the last checkpoint replaces them and the trainer trains on.
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    trainer.train_step()
    directory = save_checkpoint(trainer, str(tmp_path / "ck"))
    trainer.begin_step()
    while not trainer.executor.done:
        trainer.executor.step_action()
    real_step = trainer.optimizer.step

    def fail_half_way(**kw):
        with torch.no_grad():
            next(iter(trainer.chunks[0].parameters())).add_(1.0)
        raise RuntimeError("injected")
    trainer.optimizer.step = fail_half_way
    with pytest.raises(RuntimeError, match="injected"):
        trainer.finish_step()
    trainer.optimizer.step = real_step
    trainer.abandon_step()
    assert trainer.updating
    with pytest.raises(RuntimeError, match=r"save_checkpoint: rank 0 failed while the optimizer was updating the "
                                           r"weights of step 1, so its weights are torn"):
        save_checkpoint(trainer, str(tmp_path / "ck"))
    for call in (trainer.begin_step, trainer.train_step):
        with pytest.raises(RuntimeError, match=r"begin_step: rank 0 failed while the optimizer was updating the "
                                               r"weights of step 1, so they are torn .* load the last checkpoint"):
            call()
    assert load_checkpoint(trainer, directory) == 1 and not trainer.updating
    reference = Trainer(BASE, groups=ProcessGroups.single())
    reference.train_step()
    assert trainer.train_step()["loss"] == reference.train_step()["loss"]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ck") / "run")
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    trainer.train_step()
    return save_checkpoint(trainer, directory)


def test_checkpoint_of_another_model_is_refused(small_checkpoint):
    other = BASE.replace(model={"hidden": 64})
    with pytest.raises(CheckpointError, match=r"another model configuration \(hidden: checkpoint 32 vs model 64\)"):
        load_checkpoint(Trainer(other, groups=ProcessGroups.single()), small_checkpoint)


def test_missing_and_truncated_shards_are_named(small_checkpoint, tmp_path):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(small_checkpoint, broken)
    shard = os.path.join(broken, "shard_tp0_pp0.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=rf"{shard} is truncated or corrupt"):
        load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), broken)
    os.remove(shard)
    with pytest.raises(CheckpointError, match=rf"{shard} is missing"):
        load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), broken)


def test_saving_the_same_step_again_writes_new_then_switches(small_checkpoint, tmp_path):
    import shutil

    directory = str(tmp_path / "again")
    shutil.copytree(os.path.dirname(small_checkpoint), directory)
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    load_checkpoint(trainer, directory)
    # A crash while writing the same step again leaves the old checkpoint, and `latest`, intact.
    def crash(path):
        raise OSError("disk full (injected)")
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(trainer, directory, _before_write=crash)
    assert open(os.path.join(directory, "latest")).read() == "step_000001"
    assert load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), directory) == 1
    # Saved again for real: a new folder, `latest` switched to it, then the old one removed.
    path = save_checkpoint(trainer, directory)
    assert os.path.basename(path) == "step_000001.1" == open(os.path.join(directory, "latest")).read()
    assert not os.path.exists(os.path.join(directory, "step_000001"))
    assert load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), directory) == 1
    # keep=1: older checkpoints go once the new one is in place.
    trainer.train_step()
    save_checkpoint(trainer, directory, keep=1)
    assert sorted(e for e in os.listdir(directory) if e.startswith("step_")) == ["step_000002"]


def test_flipped_byte_and_damaged_metadata_are_named(small_checkpoint, tmp_path):
    import shutil

    broken = str(tmp_path / "flip")
    shutil.copytree(small_checkpoint, broken)
    shard = os.path.join(broken, "shard_tp0_pp0.pt")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01                        # one bit inside a tensor
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard} is corrupt: its SHA-256 does not match"):
        load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), broken)
    meta = os.path.join(broken, "metadata.json")
    good = open(meta).read()
    for damage, needle in [(good[: len(good) // 2], "is damaged: Expecting|is damaged: Unterminated"),
                           (json.dumps({**json.loads(good), "files": None}), "is damaged: files is not"),
                           (json.dumps({k: v for k, v in json.loads(good).items() if k != "topology"}),
                            "is damaged: no 'topology' entry"),
                           ("[]", "is damaged: not a JSON object")]:
        open(meta, "w").write(damage)
        with pytest.raises(CheckpointError, match=rf"checkpoint metadata {meta} {needle}"):
            load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), broken)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), str(tmp_path / "nowhere"))
    pointer_dir = str(tmp_path / "pointer")
    os.makedirs(pointer_dir)
    open(os.path.join(pointer_dir, "latest"), "w").write("step_000009")
    with pytest.raises(CheckpointError, match=r"latest names 'step_000009', which is not a checkpoint folder"):
        load_checkpoint(Trainer(BASE, groups=ProcessGroups.single()), pointer_dir)


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("change,needle", [
    (dict(grad_clip=-1.0), r"grad_clip=-1.0 must be >= 0 \(a negative clip turns the update into gradient ascent\)"),
    (dict(eps=0.0), r"eps=0.0 must be > 0"),
    (dict(beta1=1.0), r"beta1=1.0 must be in \[0, 1\)"),
    (dict(beta2=-0.1), r"beta2=-0.1 must be in \[0, 1\)"),
    (dict(weight_decay=-0.01), r"weight_decay=-0.01 must be >= 0"),
    (dict(seed=1.5), r"seed=1.5 must be an integer >= 0"),
    (dict(sequence_parallel="false"), r"sequence_parallel='false' must be true or false \(a bool, not str\)"),
    (dict(zero1=1), r"zero1=1 must be true or false"),
    (dict(warmup_steps=-1), r"warmup_steps=-1 must be an integer >= 0"),
    (dict(lr=float("nan")), r"lr=nan must be a number"),
    (dict(lr=float("inf")), r"lr=inf must be a finite number"),
    (dict(weight_decay=float("inf")), r"weight_decay=inf must be a finite number"),
    (dict(model={"vocab_size": 101}), r"model.vocab_size=101 is smaller than the byte tokenizer's vocabulary \(256\)"),
    (dict(model={"seed": "7"}), r"GPTConfig: seed='7' must be an integer >= 0"),
    (dict(model={"tie_embeddings": "yes"}), r"tie_embeddings='yes' must be true or false"),
    (dict(batch_p2p="auto"), r"batch_p2p='auto' must be true or false"),
    (dict(chunks=None), r"chunks=None must be an integer >= 1"),
    (dict(chunks="2"), r"chunks='2' must be an integer >= 1"),
    # a few zeros too many: refused at once, not by building a schedule of 5e8 microbatches (memory)
    (dict(global_batch_size=10**9), r"global_batch_size=1000000000 makes 500000000 microbatches per step "
                                    r"\(micro_batch_size=2 x dp=1 samples each\), more than the 65536"),
])
def test_bad_train_configs_are_named(change, needle):
    with pytest.raises(ValueError, match=needle):
        BASE.replace(**change)


@pytest.mark.parametrize("flags,needle", [(["--steps", "-1"], "--steps=-1 must be >= 0"),
                                          (["--save-every", "-2"], "--save-every=-2 must be >= 0"),
                                          (["--grad-clip", "-1"], "grad_clip=-1.0 must be >= 0"),
                                          (["--save-every", "5"], "--save-every needs --save-dir"),
                                          (["--top-k", "4", "--moe-capacity-factor", "1"], "--top-k, "
                                           "--moe-capacity-factor apply to a mixture of experts, and this model has "
                                           "none: add --experts N"),
                                          (["--top-k", "2"], "--top-k applies to a mixture of experts"),
                                          (["--no-moe-renormalize"], "--no-moe-renormalize applies to a mixture "
                                           "of experts"),
                                          # GPTConfig's message names a field a command line has not got
                                          (["--experts", "4", "--top-k", "1"], "--top-k 1 with renormalised "
                                           "expert weights gives every token weight 1 and the router no gradient "
                                           "from the loss: add --no-moe-renormalize"),
                                          (["--experts", "4", "--top-k", "1", "--moe-renormalize"], "add "
                                           "--no-moe-renormalize"),
                                          # started as one process: the message gives the launch command
                                          ([], "run it as torchrun --nproc-per-node 4 -m mlmkit.train ..., or "
                                           "add --tp 1 --pp 1 --dp 1 --cp 1"),
                                          (["--pp", "1", "--dp", "4"], "world size 1 does not match "
                                           "Topology(tp=2, pp=1, dp=4)"),
                                          (["--pp", "1", "--dp", "4"], "torchrun --nproc-per-node 8 "),
                                          # torchrun's variables without its rendezvous address
                                          ({"RANK": "0", "WORLD_SIZE": "4"}, "MASTER_ADDR and MASTER_PORT are "
                                           "not set")])
def test_bad_cli_flags_fail_before_any_process_group(flags, needle):
    # as a user's shell starts it: no launcher's variables (the suite may itself run under srun)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                        "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if isinstance(flags, dict):          # a launcher's variables, no flags
        env, flags = {**env, **flags}, []
    # -X importtime lists every module imported: each refusal comes before torch (which takes
    # seconds to import; the world size check once came after it)
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "mlmkit.train", *flags], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode != 0 and needle in out.stderr, out.stderr[-2000:]
    imported = re.findall(r"^import time:.*\|\s*(\S+)$", out.stderr, re.M)
    assert "mlmkit.train.config" in imported and "torch" not in imported, [m for m in imported if "torch" in m][:5]


def test_a_batch_rank_dying_in_cpp_shows_where(tmp_path):
    # A rank aborted by a library (C++ std::terminate, a segfault) left only "Signal 6 (SIGABRT)"
    # in the job's log. The entry point now has faulthandler print every thread's Python stack.
    code = ("import os, sys\n"
            "import mlmkit.train.trainer as trainer\n"
            "from mlmkit.train.__main__ import main\n"
            "def dies_in_cpp(self):\n"
            "    os.abort()\n"
            "trainer.Trainer.train_step = dies_in_cpp\n"
            "sys.exit(main(['--tp', '1', '--pp', '1', '--steps', '1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode != 0
    assert "Fatal Python error: Aborted" in out.stderr, out.stderr[-2000:]
    assert "dies_in_cpp" in out.stderr and "in main" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("corpus,needle", [
    ("missing.txt", "does not exist"), (".", "is a directory"),
    ("short.txt", "has 5 bytes (tokens), too few for one window of seq_len+1=33")])
def test_a_corpus_no_rank_can_read_fails_before_any_process_group(corpus, needle, tmp_path):
    # It failed in every rank's Trainer, after the process groups were built, with a traceback.
    (tmp_path / "short.txt").write_text("short")
    path = str(tmp_path / corpus)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"model": {"vocab_size": 256, "seq_len": 32, "hidden": 64, "heads": 4, "layers": 4},
                                  "corpus": path, "max_steps": 1}))
    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and f"python -m mlmkit.train: corpus={path!r} {needle}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "TrainConfig: expected an object of field names and values, got list [1, 2]"),
    ('{"model": [1]}', "TrainConfig.model must be a GPTConfig, got list"),
    # a model or config without its required fields raised a TypeError from the constructor
    ('{"model": {"hidden": 64}}', "GPTConfig: missing key(s) ['vocab_size', 'seq_len', 'heads', 'layers']; each "
                                  "needs a value"),
    ('{"tp": 2}', "TrainConfig: missing key(s) ['model']; each needs a value"),
    ('{"model": {"vocab_size": 256}, "tp": 2', "not valid JSON"),
    (None, "cannot be read: Is a directory")])
def test_a_config_file_that_is_no_config_is_named(text, needle, tmp_path):
    # A JSON list was reported as "unknown key(s) [1, 2]"; a folder (or a missing file) raised
    # IsADirectoryError (FileNotFoundError) from the command line, with a traceback.
    path = tmp_path / "run.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=rf"config file {path if text else tmp_path}:? .*{re.escape(needle)}"):
        TrainConfig.from_file(str(path) if text else str(tmp_path))


@pytest.mark.parametrize("flag", ["--load", "--save-dir", "--metrics-out"])
def test_an_empty_path_flag_is_refused_before_the_run(flag):
    # "" passed the path checks as the current folder; --metrics-out '' failed to open only after the
    # whole run had trained.
    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--print-world-size", flag, ""], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and f"python -m mlmkit.train: {flag}='' is empty: give a path" in out.stderr, out.stderr


def test_a_batch_job_records_no_traces(tmp_path):
    # It recorded every collective and action of every step and wrote none of them: 75 rows and
    # about 50 KB more per rank and step for the quickstart model, for as long as the job ran.
    from mlmkit.train.__main__ import _parse, build_config

    config = tmp_path / "run.json"
    BASE.replace(tracing=True).save(str(config))
    for argv in ([], ["--config", str(config)], ["--config", str(config), "--tp", "2"]):
        assert build_config(_parse(argv)).tracing is False, argv


def test_a_schedule_flag_brings_its_chunks(tmp_path):
    # `--schedule zb-v` alone was refused ("runs exactly 2 model chunks per rank ... not chunks=1"),
    # and a config of a V schedule given `--schedule 1f1b` was refused for its chunks=2: the one
    # chunk count those schedules run is taken unless --chunks says otherwise.
    from mlmkit.train.__main__ import _parse, build_config

    def chunks(*argv):
        cfg = build_config(_parse(list(argv)))
        return cfg.schedule, cfg.chunks

    assert chunks("--schedule", "zb-v") == ("zb-v", 2) and chunks("--schedule", "dualpipev", "--global-batch-size",
                                                                   "32") == ("dualpipev", 2)
    assert chunks("--schedule", "interleaved-1f1b") == ("interleaved-1f1b", 2)
    config = tmp_path / "v.json"
    demo_config(schedule="zb-v", chunks=2).save(str(config))
    for name in ("1f1b", "zb-h1", "gpipe"):
        assert chunks("--config", str(config), "--schedule", name) == (name, 1)
    assert chunks("--config", str(config)) == ("zb-v", 2)
    with pytest.raises(ValueError, match=r"'zb-v' runs exactly 2 model chunks per rank, in a V \(chunks=2\), not "
                                         r"chunks=1"):
        build_config(_parse(["--schedule", "zb-v", "--chunks", "1"]))      # said outright: refused, as before


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_schedule_file_is_read_checked_and_carried(tmp_path, monkeypatch):
    # A schedule of one's own, in torch's CSV: read when the config is made, its path kept absolute
    # (engines and torchrun ranks may start elsewhere), and the order read carried with the config,
    # so a pickled config (what a cluster session sends its engines) runs the order that was checked.
    import pickle

    from mlmkit.pipeline import from_torch, to_torch_csv

    named = BASE.replace(pp=2, schedule="zb-v", chunks=2)
    monkeypatch.chdir(tmp_path)
    to_torch_csv(named.pipeline_schedule(), "zbv.csv", format="compute_comms")
    cfg = named.replace(schedule="zbv.csv")
    assert cfg.schedule == str(tmp_path / "zbv.csv") and cfg.schedule_file and cfg.placement == "v"
    got, want = cfg.pipeline_schedule(), named.pipeline_schedule()
    assert [got.compute_actions(r) for r in range(2)] == [want.compute_actions(r) for r in range(2)]
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    (tmp_path / "zbv.csv").unlink()
    sent = pickle.loads(pickle.dumps(cfg))
    assert sent.pipeline_schedule().compute_actions(1) == want.compute_actions(1)
    # gpipe's order in a file on a loop of one chunk: the file's order, not a generator's
    to_torch_csv(BASE.replace(pp=2, schedule="gpipe").pipeline_schedule(), "g.csv")
    order = BASE.replace(pp=2, schedule="g.csv").pipeline_schedule()
    assert order.compute_actions(0) == from_torch("g.csv").compute_actions(0)
    assert [a.kind for a in order.compute_actions(0)] == ["F"] * 8 + ["B"] * 8


@pytest.mark.parametrize("change,needle", [
    (dict(chunks=1), r"runs 2 pipeline ranks with 2 chunk\(s\) each and 8 microbatches; this config has pp=2, "
                     r"chunks=1 and 8 microbatches: set chunks=2, or write the schedule for this layout"),
    (dict(global_batch_size=32), r"and 16 microbatches: set global_batch_size=16 \(microbatches = global_batch_size "
                                 r"/ \(micro_batch_size x dp\) = global_batch_size / 2\)"),
    (dict(pp=1, dp=2, global_batch_size=32), r"this config has pp=1, chunks=2 and 8 microbatches: set pp=2, or"),
    (dict(microbatch_group=4), r"microbatch_group=4 groups the microbatches of the interleaved-1f1b generator; a "
                               r"schedule file already has its order: drop microbatch_group"),
    (dict(schedule="missing.csv"), r"schedule file .*missing.csv cannot be read: No such file or directory"),
    (dict(schedule="folder.csv"), r"schedule file .*folder.csv cannot be read: Is a directory"),
    (dict(schedule="words.csv"), r"schedule file .*words.csv: 'hello' is not an action of torch's pipeline "
                                 r"notation"),
    (dict(schedule="empty.csv"), r"schedule file .*empty.csv: the torch schedule has no compute action"),
    (dict(schedule="twice.csv"), r"schedule file .*twice.csv: stage 0 appears on ranks 0 and 1"),
    # rank 1 runs its backward before its forward
    (dict(schedule="early.csv"), r"schedule file .*early.csv cannot run: rank 1"),
    (dict(schedule="nothing"), r"unknown schedule 'nothing'; choose one of gpipe, 1f1b, .*, or give the path of "
                               r"a CSV file in torch's pipeline format \(ending in .csv"),
])
def test_a_schedule_file_that_cannot_be_this_runs_is_named(change, needle, tmp_path, monkeypatch):
    from mlmkit.pipeline import to_torch_csv

    monkeypatch.chdir(tmp_path)
    zbv = BASE.replace(pp=2, schedule="zb-v", chunks=2)
    to_torch_csv(zbv.pipeline_schedule(), "zbv.csv")
    (tmp_path / "folder.csv").mkdir()
    _write(tmp_path / "words.csv", "0F0,hello\n")
    _write(tmp_path / "empty.csv", "")
    _write(tmp_path / "twice.csv", "0F0,0B0\n0F1,0B1\n")
    _write(tmp_path / "early.csv", "0F0,0B0\n1B0,1F0\n")
    cfg = zbv.replace(schedule="zbv.csv")
    if "schedule" in change and change["schedule"] == "early.csv":
        change = dict(change, chunks=1, global_batch_size=2)        # its one microbatch, one chunk
    with pytest.raises(ValueError, match=needle):
        cfg.replace(**change)


def test_a_schedule_file_from_the_command_line_brings_its_chunks(tmp_path):
    from mlmkit.pipeline import to_torch_csv
    from mlmkit.train.__main__ import _parse, build_config

    path = to_torch_csv(demo_config(schedule="zb-v", chunks=2).pipeline_schedule(), str(tmp_path / "v.csv"))
    cfg = build_config(_parse(["--schedule", path]))
    assert (cfg.schedule, cfg.chunks, cfg.placement) == (path, 2, "v")
    with pytest.raises(ValueError, match=r"set chunks=2"):
        build_config(_parse(["--schedule", path, "--chunks", "1"]))
    with pytest.raises(ValueError, match=r"v.csv cannot be read: No such file"):
        build_config(_parse(["--schedule", str(tmp_path / "none" / "v.csv")]))


def test_top_1_routing_from_the_command_line(tmp_path):
    # `--experts 4 --top-k 1` was refused by GPTConfig with "set moe_renormalize=False", a field no
    # flag set: top-1 (Switch) routing needed a config file. --no-moe-renormalize sets it.
    from mlmkit.train.__main__ import _parse, build_config

    model = build_config(_parse(["--tp", "1", "--experts", "4", "--top-k", "1", "--no-moe-renormalize"])).model
    assert (model.experts, model.top_k, model.moe_renormalize) == (4, 1, False)
    assert build_config(_parse(["--tp", "1", "--experts", "4"])).model.moe_renormalize is True      # the default kept
    serial = demo_config(tp=1)
    config = tmp_path / "switch.json"
    serial.replace(model=dataclasses.replace(serial.model, experts=4, top_k=1, moe_renormalize=False)).save(str(config))
    assert build_config(_parse(["--config", str(config)])).model.moe_renormalize is False
    with pytest.raises(ValueError, match=r"^top_k=1 \(the config's\) with renormalised expert weights gives every "
                                         r"token weight 1 .* add --no-moe-renormalize"):
        build_config(_parse(["--config", str(config), "--moe-renormalize"]))
    with pytest.raises(ValueError, match=r"^--top-k 1 with renormalised expert weights"):
        build_config(_parse(["--tp", "1", "--experts", "4", "--top-k", "1"]))


def test_files_a_run_reads_and_writes_are_checked_before_it_starts(tmp_path):
    # --save-dir on a file and --metrics-out in a missing folder failed after the whole run (its
    # work lost), --load of a missing checkpoint or of another model's after the process groups
    # were built, each with a traceback.
    trainer = Trainer(BASE, groups=ProcessGroups.single())
    save_checkpoint(trainer, str(tmp_path / "ckpt"))
    config = tmp_path / "run.json"
    BASE.save(str(config))
    (tmp_path / "a_file").write_text("")
    ckpt, a_file = str(tmp_path / "ckpt"), str(tmp_path / "a_file")
    cases = [
        (["--load", str(tmp_path / "none")], f"--load={str(tmp_path / 'none')!r}: no checkpoint at "),
        (["--load", ckpt, "--kv-heads", "2"], f"--load={ckpt!r}: checkpoint {ckpt}/step_000000 was saved from another "
                                              "model configuration (kv_heads: checkpoint None vs model 2)"),
        (["--save-dir", a_file], f"--save-dir={a_file!r} is a file: give a folder"),
        (["--save-dir", a_file + "/sub"], f"--save-dir={a_file + '/sub'!r} cannot be created or written to"),
        (["--metrics-out", str(tmp_path / "no" / "m.csv")],
         f"--metrics-out={str(tmp_path / 'no' / 'm.csv')!r}: the folder {str(tmp_path / 'no')!r} does not exist"),
        (["--metrics-out", str(tmp_path)], f"--metrics-out={str(tmp_path)!r} is a folder: give a file name"),
        (["--config", str(tmp_path / "none.json")],
         f"config file {tmp_path / 'none.json'} cannot be read: No such file"),
    ]
    if os.path.isdir("/proc/self"):
        # a folder whose permission bits let root write but that takes no new entry: the run failed at
        # its end, when it saved
        cases += [(["--save-dir", "/proc/mlmkit-x"], "--save-dir='/proc/mlmkit-x' cannot be created or written to"),
                  (["--metrics-out", "/proc/m.csv"], "--metrics-out='/proc/m.csv' cannot be written")]
    for flags, needle in cases:
        out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config), "--steps", "1", *flags],
                             capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
        assert out.returncode != 0 and f"python -m mlmkit.train: {needle}" in out.stderr, (flags, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and '"loss"' not in out.stdout, flags
    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config), "--steps", "1", "--load", ckpt,
                          "--save-dir", str(tmp_path / "new" / "dir"), "--metrics-out", "m.csv"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "m.csv").exists() and os.path.exists(tmp_path / "new" / "dir" / "step_000001" / "metadata.json")
    # A run resumed at or past max_steps without --steps trained nothing ("steps 1..0") and saved the
    # checkpoint again under another name; refused before it starts. With --steps it trains on.
    done = str(tmp_path / "new" / "dir")
    for flags, needle in ((["--max-steps", "1", "--warmup-steps", "0"], "resumes at step 1, and max_steps=1: nothing "
                                                                         "is left to train; pass "
                                                  "--steps N for N more steps"),):
        out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config), "--load", done, "--save-dir",
                              done, *flags], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
        assert out.returncode != 0 and f"python -m mlmkit.train: --load={done!r} {needle}" in out.stderr, out.stderr[-2000:]
        assert sorted(os.listdir(done)) == ["latest", "step_000001"]
    out = subprocess.run([sys.executable, "-m", "mlmkit.train", "--config", str(config), "--load", done, "--max-steps", "1",
                          "--warmup-steps", "0", "--steps", "1", "--save-dir", done], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and '"step": 1' in out.stdout, out.stderr[-2000:]
    assert "step_000002" in os.listdir(done)


@pytest.mark.parametrize("content", [b"ab\r\n" * 5, b"line\rone\r\n" + "d\xe9j\xe0 vu!".encode("latin-1"),
                                     bytes(range(256)) + b"\xff\xfe", b"x" * 17])
def test_a_corpus_is_read_as_its_bytes_and_every_window_is_drawn(content, tmp_path):
    # A corpus was decoded as UTF-8 in text mode: CRLF line ends became one token (a 20-byte file
    # passed the size check and then every rank failed in torch.randint), a Latin-1 file raised
    # UnicodeDecodeError on every rank, and the corpus's last byte was never a target.
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    seq_len = 16
    check_corpus(str(path), seq_len=seq_len)              # passes: len(content) >= seq_len + 1
    data = TextData(seq_len=seq_len, path=str(path))
    assert data.tokens.tolist() == list(content)
    windows = {bytes(content[i:i + seq_len + 1]) for i in range(len(content) - seq_len)}
    seen = set()
    for step in range(1000):                              # 8000 draws of at most 242 windows
        tokens, targets = data.batch(step, 8)
        assert torch.equal(tokens[:, 1:], targets[:, :-1])
        seen |= {bytes(t + [y]) for t, y in zip(tokens.tolist(), targets[:, -1].tolist())}
    assert seen == windows                                # every window, the last byte's included, none else
    n = len(content)
    with pytest.raises(ValueError, match=rf"has {n} bytes \(tokens\), too few for one window of seq_len\+1={n + 1}"):
        check_corpus(str(path), seq_len=n)
    # a pathlib.Path names the same file (it was refused as "must be a file path (str)")
    cfg = BASE.replace(corpus=path)
    assert cfg.corpus == str(path) and TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_fit_past_max_steps_or_with_negative_steps_is_refused():
    # fit() trains "up to max_steps": past them it ran range(negative), nothing, without a word.
    trainer = Trainer(BASE.replace(max_steps=1, warmup_steps=0, tracing=False), groups=ProcessGroups.single())
    assert len(trainer.fit(progress=False)) == 1 and len(trainer.fit(progress=False)) == 1     # done: 0 more
    trainer.fit(1, progress=False)
    with pytest.raises(ValueError, match=r"at step 2, past max_steps=1: pass steps=N to train N more steps"):
        trainer.fit(progress=False)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"steps must be a whole number >= 0"):
            trainer.fit(bad, progress=False)
    # Past max_steps the learning rate is min_lr, also when the warm-up is longer than the run (a
    # quick max_steps=2 with the default warmup_steps=5 went on warming up past max_steps).
    for step in range(2, 8):
        assert lr_at(step, lr=1.0, min_lr=0.1, warmup_steps=5, max_steps=2) == 0.1
    assert [lr_at(s, lr=1.0, min_lr=0.1, warmup_steps=5, max_steps=2) for s in (0, 1)] == [0.2, 0.4]


def test_lr_schedule_is_megatrons_cosine_with_the_warmup_one_step_earlier():
    # Megatron-LM's OptimizerParamScheduler, as its training loop drives it: the rate of update s
    # (0-based) is get_lr() at num_steps = s * global_batch (it steps after each update, counting
    # samples), init_lr = 0. mlmkit's decay must be that one; its warm-up runs one step earlier.
    def megatron(s, *, lr, min_lr, warmup, decay, gbs=8):
        n, w, d = s * gbs, warmup * gbs, decay * gbs
        if w > 0 and n <= w:
            return lr * n / w
        if n > d:
            return min_lr
        return min_lr + 0.5 * (lr - min_lr) * (math.cos(math.pi * (n - w) / (d - w)) + 1.0)

    for warmup, decay in ((0, 7), (1, 5), (3, 10), (4, 5)):
        kw = dict(lr=3e-3, min_lr=3e-4)
        ours = [lr_at(s, warmup_steps=warmup, max_steps=decay, **kw) for s in range(decay + 3)]
        theirs = [megatron(s, warmup=warmup, decay=decay, **kw) for s in range(decay + 3)]
        assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=0), (warmup, decay)
        assert ours[:warmup] == pytest.approx(theirs[1:warmup + 1], rel=1e-12), (warmup, decay)


def test_global_batch_not_divisible():
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by micro_batch_size x dp = 2 x 2 = 4"):
        BASE.replace(dp=2, global_batch_size=10)


def test_config_file_with_unknown_key(tmp_path):
    path = tmp_path / "run.json"
    data = BASE.to_dict()
    data["learning_rate"] = 0.1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"config file {path}: TrainConfig: unknown key\(s\) \['learning_rate'\]"):
        TrainConfig.from_file(str(path))
    data.pop("learning_rate")
    data["model"]["hiden"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"GPTConfig: unknown key\(s\) \['hiden'\]"):
        TrainConfig.from_file(str(path))


def test_round_trip_config_file(tmp_path):
    path = str(tmp_path / "run.json")
    BASE.save(path)
    assert TrainConfig.from_file(path) == BASE


# ----------------------------------------------------------------------------------- batch launch
def test_torchrun_command_from_readme(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    metrics = tmp_path / "metrics.csv"
    cmd = [torchrun, "--nproc-per-node", "4", "-m", "mlmkit.train", "--max-steps", "20",
           "--metrics-out", str(metrics), "--save-dir", str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(metrics)
    assert len(df) == 20
    assert df.loss.iloc[-3:].mean() < df.loss.iloc[:3].mean() - 0.5
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_000020"


def test_a_batch_job_trains_with_a_schedule_file(tmp_path):
    # `--schedule zbh1.csv` (relative: the ranks' folder) under torchrun: the file's order, zb-h1's
    # exported, trains as `--schedule zb-h1` does, step for step.
    import pandas as pd

    from mlmkit.pipeline import to_torch_csv

    to_torch_csv(demo_config(tp=1, pp=2, schedule="zb-h1").pipeline_schedule(), str(tmp_path / "zbh1.csv"))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    losses = {}
    for schedule in ("zbh1.csv", "zb-h1"):
        metrics = tmp_path / f"{schedule}.metrics"
        cmd = [torchrun, "--nproc-per-node", "2", "-m", "mlmkit.train", "--tp", "1", "--pp", "2", "--steps", "3",
               "--schedule", schedule, "--metrics-out", str(metrics)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-3000:]
        losses[schedule] = list(pd.read_csv(metrics).loss)
    assert len(losses["zb-h1"]) == 3
    assert losses["zbh1.csv"] == pytest.approx(losses["zb-h1"], rel=1e-6, abs=0), losses
