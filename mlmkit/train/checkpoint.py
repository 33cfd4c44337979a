"""Checkpoints: one shard per model-parallel rank plus metadata, written atomically, loadable into
any other layout, exportable as the serial model's state dict.

Layout on disk::

    ckpt/
      latest                      # name of the newest complete checkpoint ("step_000003")
      step_000003/
        metadata.json             # model and train config, topology, step, shard files and sizes
        shard_tp0_pp0.pt          # parameters, AdamW state and RNG of (tp=0, pp=0) ...
        shard_tp1_pp0.pt

Data-parallel replicas hold identical parameters and (after gathering ZeRO-1 shards) identical
optimizer state, so the dp-rank-0 rank of each (tp, pp) coordinate writes one shard.

Atomicity: every shard and the metadata go to a temporary folder ``.step_000003.tmp``; only when
all are written does rank 0 rename it and then replace ``latest`` (``os.replace``). A crash in
between leaves the previous checkpoint, and ``latest`` pointing at it, untouched.

Resharding: a shard stores each parameter's local tensor with its split dimension; loading
rebuilds the full tensor of every parameter this rank needs (concatenating the old TP slices and
finding the old pipeline stage by the parameter's global name), then slices it for the new layout.
AdamW state is resharded the same way. Files are read with ``torch.load(weights_only=True)``.
RNG state is restored only when the layout is unchanged (dropout streams depend on tp/pp rank).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from typing import Optional

import torch

from mlmkit.train.config import TrainConfig

__all__ = ["CheckpointError", "export_state_dict", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names the file or value."""


def _shard_name(tp: int, pp: int) -> str:
    return f"shard_tp{tp}_pp{pp}.pt"


def _meta(p) -> dict:
    return {"split_dim": getattr(p, "tp_split_dim", None), "global_shape": list(getattr(p, "global_shape", p.shape)),
            "vocab_rows": getattr(p, "vocab_rows", None)}


def save_checkpoint(trainer, directory: str, *, _before_write=None) -> str:
    """Write a checkpoint of ``trainer`` at its current step into ``directory``; returns its path.

    Collective over the world. ``_before_write(path)`` is a test hook called before each shard write.
    """
    groups, cfg = trainer.groups, trainer.config
    name = f"step_{trainer.step:06d}"
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp")
    if groups.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    groups.world.barrier()
    states, opt_step = trainer.optimizer.state_by_name()  # collective over dp for ZeRO-1
    c = groups.coords
    if c.dp == 0:
        shard = {
            "params": {n: p.detach().cpu().clone() for n, p in trainer.named_parameters()},
            "meta": {n: _meta(p) for n, p in trainer.named_parameters()},
            "optimizer": {n: {k: v.cpu() for k, v in s.items()} for n, s in states.items()},
            "optimizer_step": opt_step,
            "rng": [m.rng.get_state() for m in trainer.chunks],
            "torch_rng": torch.get_rng_state(),
        }
        path = os.path.join(tmp, _shard_name(c.tp, c.pp))
        if _before_write is not None:
            _before_write(path)
        torch.save(shard, path)
    groups.world.barrier()
    if groups.rank == 0:
        files = {}
        for t in range(cfg.tp):
            for p in range(cfg.pp):
                f = _shard_name(t, p)
                files[f] = os.path.getsize(os.path.join(tmp, f))
        meta = {"format": "mlmkit-checkpoint-1", "step": trainer.step, "config": cfg.to_dict(),
                "topology": asdict(cfg.topology), "files": files}
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = os.path.join(directory, ".latest.tmp")
        with open(latest_tmp, "w") as f:
            f.write(name)
        os.replace(latest_tmp, os.path.join(directory, "latest"))
    groups.world.barrier()
    return final


def latest_checkpoint(directory: str) -> str:
    """The newest complete checkpoint under ``directory`` (or ``directory`` itself if it is one)."""
    if os.path.exists(os.path.join(directory, "metadata.json")):
        return directory
    pointer = os.path.join(directory, "latest")
    if not os.path.exists(pointer):
        raise CheckpointError(f"no checkpoint in {directory}: neither metadata.json nor a 'latest' file")
    with open(pointer) as f:
        return os.path.join(directory, f.read().strip())


def _read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"checkpoint {path} has no metadata.json (incomplete or not a checkpoint)")
    with open(meta_path) as f:
        return json.load(f)


class _Shards:
    """Reads the shards of one checkpoint lazily and assembles full tensors by parameter name."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        self.tp, self.pp = meta["topology"]["tp"], meta["topology"]["pp"]
        self._cache: dict[tuple[int, int], dict] = {}

    def shard(self, tp: int, pp: int) -> dict:
        if (tp, pp) not in self._cache:
            name = _shard_name(tp, pp)
            f = os.path.join(self.path, name)
            if not os.path.exists(f):
                raise CheckpointError(f"checkpoint shard {f} is missing")
            expected = self.meta["files"].get(name)
            if expected is not None and os.path.getsize(f) != expected:
                raise CheckpointError(
                    f"checkpoint shard {f} is truncated or corrupt: {os.path.getsize(f)} bytes, metadata says {expected}")
            try:
                self._cache[(tp, pp)] = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
                raise CheckpointError(f"checkpoint shard {f} is truncated or corrupt: {err}") from None
        return self._cache[(tp, pp)]

    def _locate(self, name: str) -> Optional[int]:
        for pp in range(self.pp):
            if name in self.shard(0, pp)["params"]:
                return pp
        return None

    def full(self, name: str, *, what: str = "param", key: Optional[str] = None) -> Optional[torch.Tensor]:
        """Full tensor of parameter ``name`` (padding rows dropped), or of its optimizer ``key`` state."""
        pp = self._locate(name)
        if pp is None and name == "head_weight":
            pp, name = self._locate("embedding.weight"), "embedding.weight"  # tied: same matrix
        if pp is None:
            return None
        meta = self.shard(0, pp)["meta"][name]
        parts = []
        for tp in range(self.tp):
            sh = self.shard(tp, pp)
            if what == "param":
                parts.append(sh["params"][name])
            else:
                st = sh["optimizer"].get(name)
                if st is None:
                    return None
                parts.append(st[key])
        dim = meta["split_dim"]
        full = torch.cat(parts, dim=dim) if dim is not None else parts[0]
        if meta["vocab_rows"] is not None:
            full = full[: meta["vocab_rows"]]
        return full


def _local_slice(full: torch.Tensor, param, tp_size: int, tp_rank: int) -> torch.Tensor:
    rows = getattr(param, "vocab_rows", None)
    if rows is not None:
        padded = param.global_shape[0]
        if full.shape[0] < padded:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    dim = getattr(param, "tp_split_dim", None)
    if dim is not None:
        full = full.chunk(tp_size, dim=dim)[tp_rank]
    return full


def load_checkpoint(trainer, path: str) -> int:
    """Load the checkpoint at ``path`` (a checkpoint folder, or a folder with ``latest``) into ``trainer``,
    whatever layout it was saved in. Returns the step to continue from."""
    path = latest_checkpoint(path)
    meta = _read_metadata(path)
    saved_model = meta["config"]["model"]
    mine = trainer.config.model.to_dict()
    diff = sorted(k for k in set(saved_model) | set(mine) if saved_model.get(k) != mine.get(k))
    if diff:
        details = ", ".join(f"{k}: checkpoint {saved_model.get(k)!r} vs model {mine.get(k)!r}" for k in diff)
        raise CheckpointError(f"checkpoint {path} was saved from another model configuration ({details})")
    shards = _Shards(path, meta)
    tp, tp_rank = trainer.groups.tp.size, trainer.groups.coords.tp
    states = {}
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            full = shards.full(name)
            if full is None:
                raise CheckpointError(f"checkpoint {path} has no parameter {name!r}")
            p.copy_(_local_slice(full, p, tp, tp_rank))
            st = {}
            for key in ("exp_avg", "exp_avg_sq"):
                f = shards.full(name, what="optimizer", key=key)
                if f is not None:
                    st[key] = _local_slice(f, p, tp, tp_rank).clone()
            if st:
                states[name] = st
    opt_step = shards.shard(0, 0)["optimizer_step"]
    if states:
        trainer.optimizer.load_state_by_name(states, opt_step)
    same_layout = meta["topology"] == asdict(trainer.config.topology) and meta["config"]["chunks"] == trainer.config.chunks
    if same_layout:
        sh = shards.shard(trainer.groups.coords.tp, trainer.groups.coords.pp)
        for model, state in zip(trainer.chunks, sh["rng"]):
            model.rng.set_state(tuple(state))
        torch.set_rng_state(sh["torch_rng"])
    trainer.step = meta["step"]
    return trainer.step


def export_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint as one full state dict for the serial model ``GPT(config.model)`` (no process needed)."""
    from mlmkit.model import GPT

    path = latest_checkpoint(path)
    meta = _read_metadata(path)
    cfg = TrainConfig.from_dict(meta["config"]).model
    shards = _Shards(path, meta)
    serial = GPT(cfg)
    out = {}
    for name, p in serial.named_parameters():
        full = shards.full(name)
        if full is None:
            raise CheckpointError(f"checkpoint {path} has no parameter {name!r}")
        out[name] = _local_slice(full, p, 1, 0).clone()
    return out
