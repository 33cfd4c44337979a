"""3D training against a plain-PyTorch serial run; checkpoints that reshard and survive crashes; torchrun."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mlmkit.distributed import ProcessGroups, RankFailure, run_ranks
from mlmkit.model import GPT, GPTConfig
from mlmkit.train import TrainConfig
from mlmkit.train.checkpoint import CheckpointError, export_state_dict, load_checkpoint, save_checkpoint
from mlmkit.train.data import TextData
from mlmkit.train.lr import lr_at
from mlmkit.train.trainer import Trainer

MODEL = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4)
BASE = TrainConfig(model=MODEL, micro_batch_size=2, global_batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                   max_steps=5, grad_clip=0.5, weight_decay=0.01)
RTOL = 1e-5


def serial_losses(cfg: TrainConfig, steps: int) -> list[float]:
    """The reference: plain PyTorch on one process (GPT at tp=1, torch's AdamW and clip_grad_norm_)."""
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    data = TextData(seq_len=cfg.model.seq_len, seed=cfg.seed)
    losses = []
    for step in range(steps):
        tokens, targets = data.batch(step, cfg.global_batch_size)
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    return serial_losses(BASE, 5)


def _train(rank, world_size, cfg_dict, steps):
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology)
    trainer = Trainer(cfg, groups=groups)
    return [trainer.train_step()["loss"] for _ in range(steps)]


LAYOUTS = [(2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1)]


@pytest.mark.parametrize("zero1", [False, True], ids=["adamw", "zero1"])
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_3d_training_matches_serial(reference, tp, pp, dp, zero1):
    cfg = BASE.replace(tp=tp, pp=pp, dp=dp, zero1=zero1)
    results = run_ranks(_train, world_size=cfg.world_size, args=(cfg.to_dict(), 5), timeout_s=300)
    for rank_losses in results:
        for got, want in zip(rank_losses, reference):
            assert abs(got - want) <= RTOL * abs(want), (got, want)
    assert reference[-1] < reference[0]


def test_recompute_sequence_parallel_interleaved(reference):
    cfg = BASE.replace(tp=2, pp=2, dp=2, recompute=True, sequence_parallel=True, schedule="interleaved-1f1b",
                       chunks=2, zero1=True)
    results = run_ranks(_train, world_size=8, args=(cfg.to_dict(), 5), timeout_s=300)
    for got, want in zip(results[0], reference):
        assert abs(got - want) <= RTOL * abs(want)


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
    saved = BASE.replace(tp=2, pp=2, dp=1)
    uninterrupted = run_ranks(_save_at_3_then_continue, world_size=4, args=(saved.to_dict(), directory))[0]
    assert open(os.path.join(directory, "latest")).read() == "step_000003"
    # (1, 1, 1): in this very process, no torch.distributed at all.
    serial = Trainer(BASE, groups=ProcessGroups.single())
    assert load_checkpoint(serial, directory) == 3
    resumed_serial = [serial.train_step()["loss"] for _ in range(2)]
    resumed_122 = run_ranks(_resume, world_size=4, args=(BASE.replace(pp=2, dp=2).to_dict(), directory))[0]
    for resumed in (resumed_serial, resumed_122):
        for got, want in zip(resumed, uninterrupted):
            assert abs(got - want) <= RTOL * abs(want), (resumed, uninterrupted)
    # Exported as one state dict, the checkpoint is the serial model at step 3.
    state = export_state_dict(directory)
    model = GPT(BASE.model)
    model.load_state_dict(state)
    for name, p in serial.named_parameters():
        assert name in state or name == "head_weight"


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


# ----------------------------------------------------------------------------------- bad input
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
