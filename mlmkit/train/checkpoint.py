"""Checkpoints: one shard per model-parallel rank plus metadata, written atomically, verified on load,
loadable into any other layout, exportable as the serial model's state dict.

Layout on disk::

    ckpt/
      latest                      # name of the newest complete checkpoint ("step_000003")
      step_000003/
        metadata.json             # model and train config, topology, step, and per shard file its
                                  # size and SHA-256
        shard_tp0_pp0.pt          # parameters, AdamW state and RNG of (tp=0, pp=0) ...
        shard_tp1_pp0.pt
        experts_etp0_ep1_pp0.pt   # mixture of experts: the experts of (expert_tp=0, ep=1, pp=0)

Data-parallel (and context-parallel) replicas hold identical parameters and (after gathering
ZeRO-1 shards) identical optimizer state, so the dp-rank-0, cp-rank-0 rank of each (tp, pp)
coordinate writes one shard of the dense parameters; experts are written by the expert-dp-rank-0
rank of each (expert_tp, ep, pp) coordinate. Expert parameters carry their global expert index in
their name, so a checkpoint loads into any ep.

Write new, then switch: every shard and the metadata go to a temporary folder; when all are
written, rank 0 renames it to a folder name not in use (``step_000003``, or ``step_000003.1`` when
the same step is saved again), then replaces ``latest`` (``os.replace``, atomic), and only then
deletes what ``latest`` pointed to before if it was the same step (and, with ``keep``, older
checkpoints). A crash at any point leaves ``latest`` pointing at a complete checkpoint.

Verification: each writer hashes the bytes it writes; the metadata lists every shard's size and
SHA-256, and loading checks both, so a truncated file or a flipped byte is an error naming the file
(:class:`CheckpointError`), as is any other defect of a file (missing, unreadable, malformed
metadata).

Resharding: a shard stores each parameter's local tensor with its split dimension; loading
rebuilds the full tensor of every parameter this rank needs (concatenating the old TP slices and
finding the old pipeline stage by the parameter's global name), then slices it for the new layout.
AdamW state is resharded the same way, and an optimizer that keeps its own copy of the weights
(ZeRO-1's fp32 shard) refreshes it from the loaded parameters. Files are read with
``torch.load(weights_only=True)``. RNG state is restored only when the layout is unchanged
(dropout streams depend on tp/pp rank).
"""

from __future__ import annotations

import hashlib
import io
import json
import numbers
import os
import shutil
from dataclasses import asdict
from typing import Optional

import torch

from mlmkit.tensor_parallel.layers import shard_full, unshard
from mlmkit.train.config import TrainConfig

__all__ = ["CheckpointError", "check_checkpoint", "checkpoint_step", "export_state_dict", "holds_checkpoint",
           "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "mlmkit-checkpoint-2"
_FORMATS = ("mlmkit-checkpoint-1", FORMAT)   # version 1: sizes only, no checksums


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names the file or value."""


def _shard_name(tp: int, pp: int) -> str:
    return f"shard_tp{tp}_pp{pp}.pt"


def _expert_shard_name(expert_tp: int, ep: int, pp: int) -> str:
    return f"experts_etp{expert_tp}_ep{ep}_pp{pp}.pt"


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _meta(p) -> dict:
    return {"split_dim": getattr(p, "tp_split_dim", None), "global_shape": list(getattr(p, "global_shape", p.shape)),
            "vocab_rows": getattr(p, "vocab_rows", None), "partitions": getattr(p, "tp_partitions", 1),
            "replicas": getattr(p, "tp_replicas", 1)}


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_between_steps(trainer, what: str, *, loading: bool = False) -> None:
    # Before any collective: in SPMD code every rank is in the same state here, so every rank raises.
    if trainer.in_step:
        ex = trainer.executor
        where = (f"action {ex.index} of {len(ex.actions)} done" if not ex.done
                 else "its actions done, the optimizer step not yet taken")
        fix = ("finish it (trainer.finish_step() once the executor is done) or drop it (trainer.abandon_step())"
               if not loading else "drop it first (trainer.abandon_step()), or load into a new Trainer")
        raise RuntimeError(
            f"{what}: step {trainer.step} is in progress on rank {trainer.groups.rank} ({where}); "
            + ("a checkpoint holds the state between steps, and this one's random streams have already drawn "
               "part of the step's dropout masks (resumed, the step would not repeat). "
               if not loading else "its activations and messages belong to the weights it started with. ")
            + f"{fix[0].upper()}{fix[1:]}")
    if trainer.updating and not loading:
        raise RuntimeError(
            f"{what}: rank {trainer.groups.rank} failed while the optimizer was updating the weights of step "
            f"{trainer.step}, so its weights are torn (part old, part new); load the last checkpoint instead "
            f"(load_checkpoint) of saving these")


def save_checkpoint(trainer, directory: str, *, keep: Optional[int] = None, _before_write=None) -> str:
    """Write a checkpoint of ``trainer`` at its current step into ``directory``; returns its path.

    Collective over the world. Between steps only: a step in progress (``trainer.in_step``) or weights
    torn by a failure in the optimizer update raise RuntimeError on every rank before anything is
    written. ``keep``: after the switch, delete all but the newest ``keep``
    checkpoints of ``directory``. ``_before_write(path)`` is a test hook called before each shard
    write.
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1):
        raise ValueError(f"save_checkpoint: keep={keep!r} must be an integer >= 1 (or None: keep all)")
    _check_between_steps(trainer, "save_checkpoint")
    groups, cfg = trainer.groups, trainer.config
    name = f"step_{trainer.step:06d}"
    tmp = os.path.join(directory, f".{name}.tmp")
    if groups.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    groups.world.barrier()
    states, opt_step = trainer.optimizer.state_by_name()  # collective over dp for ZeRO-1
    c = groups.coords
    named = list(trainer.named_parameters())
    with trainer.full_parameters():                   # ZeRO-3: gathered for the copy, freed after
        values = {n: p.detach().cpu().clone() for n, p in named}
    dense = [(n, p) for n, p in named if not getattr(p, "expert", False)]
    expert = [(n, p) for n, p in named if getattr(p, "expert", False)]

    def write(file_name: str, params) -> None:
        shard = {
            "params": {n: values[n] for n, _ in params},
            "meta": {n: _meta(p) for n, p in params},
            "optimizer": {n: {k: v.cpu() for k, v in states[n].items()} for n, _ in params if n in states},
            "optimizer_step": opt_step,
            "rng": [m.rng.get_state() for m in trainer.chunks],
            "torch_rng": torch.get_rng_state(),
        }
        path = os.path.join(tmp, file_name)
        buf = io.BytesIO()
        torch.save(shard, buf)
        data = buf.getvalue()
        if _before_write is not None:
            _before_write(path)
        _write_file(path, data)
        digest = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _write_file(path + ".sha256", json.dumps(digest).encode())

    if c.dp == 0 and c.cp == 0:       # dp and cp replicas hold the same dense parameters
        write(_shard_name(c.tp, c.pp), dense)
    e = cfg.topology.expert_coords(groups.rank)
    if expert and e.dp == 0:          # expert-dp replicas hold the same experts
        write(_expert_shard_name(e.tp, e.ep, e.pp), expert)
    groups.world.barrier()
    if groups.rank == 0:
        names = [_shard_name(t, p) for t in range(cfg.tp) for p in range(cfg.pp)]
        if cfg.model.moe:
            names += [_expert_shard_name(t, ep, p) for t in range(cfg.expert_tp) for ep in range(cfg.ep)
                      for p in range(cfg.pp)]
        files = {}
        for f in names:
            side = os.path.join(tmp, f + ".sha256")
            with open(side) as fh:
                files[f] = json.load(fh)
            os.remove(side)
        meta = {"format": FORMAT, "step": trainer.step, "config": cfg.to_dict(),
                "topology": asdict(cfg.topology), "files": files}
        _write_file(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=2).encode())
        previous = _pointed(directory)
        final_name = name
        k = 0
        while os.path.exists(os.path.join(directory, final_name)):
            k += 1
            final_name = f"{name}.{k}"
        os.rename(tmp, os.path.join(directory, final_name))
        latest_tmp = os.path.join(directory, ".latest.tmp")
        _write_file(latest_tmp, final_name.encode())
        os.replace(latest_tmp, os.path.join(directory, "latest"))
        # Only now is the old one unreferenced.
        if previous is not None and previous.split(".")[0] == name:
            shutil.rmtree(os.path.join(directory, previous), ignore_errors=True)
        if keep is not None:
            for old in _checkpoint_folders(directory)[:-keep]:
                if old != final_name:
                    shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    groups.world.barrier()
    return latest_checkpoint(directory)


def _pointed(directory: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _checkpoint_folders(directory: str) -> list[str]:
    """Complete checkpoint folders of ``directory``, oldest first (by step, then by save)."""
    out = []
    for entry in os.listdir(directory):
        if entry.startswith("step_") and os.path.exists(os.path.join(directory, entry, "metadata.json")):
            head, _, again = entry.partition(".")
            try:
                out.append((int(head[len("step_"):]), int(again or 0), entry))
            except ValueError:
                continue
    return [e for *_, e in sorted(out)]


def holds_checkpoint(directory: str) -> bool:
    """``directory`` is a checkpoint folder or a folder of them (a ``latest`` pointer), complete or
    not: what :func:`latest_checkpoint` would try to read."""
    return os.path.exists(os.path.join(directory, "metadata.json")) or os.path.exists(os.path.join(directory, "latest"))


def latest_checkpoint(directory: str) -> str:
    """The newest complete checkpoint under ``directory`` (or ``directory`` itself if it is one)."""
    if os.path.exists(os.path.join(directory, "metadata.json")):
        return directory
    pointer = os.path.join(directory, "latest")
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint at {directory}: the folder does not exist")
    if not os.path.exists(pointer):
        raise CheckpointError(f"no checkpoint in {directory}: neither metadata.json nor a 'latest' file")
    try:
        with open(pointer) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint pointer {pointer} cannot be read: {err}") from None
    path = os.path.join(directory, name)
    if not name or os.sep in name or not os.path.isdir(path):
        raise CheckpointError(f"checkpoint pointer {pointer} names {name!r}, which is not a checkpoint folder "
                              f"in {directory}")
    return path


def _read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"checkpoint {path} has no metadata.json (incomplete or not a checkpoint)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint metadata {meta_path} is damaged: {err}") from None
    try:
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        if meta.get("format") not in _FORMATS:
            raise ValueError(f"format {meta.get('format')!r} is not one of {list(_FORMATS)}")
        if isinstance(meta["step"], bool) or not isinstance(meta["step"], int) or meta["step"] < 0:
            raise ValueError(f"step {meta['step']!r} is not a step number")
        topo = meta["topology"]
        for axis in ("tp", "pp", "dp"):
            if isinstance(topo[axis], bool) or not isinstance(topo[axis], int) or topo[axis] < 1:
                raise ValueError(f"topology {topo!r} is not a rank grid")
        if not isinstance(meta["config"], dict) or not isinstance(meta["config"].get("model"), dict):
            raise ValueError("config has no model section")
        if not isinstance(meta["files"], dict):
            raise ValueError("files is not a table of shard files")
    except (KeyError, TypeError, ValueError) as err:
        missing = f"no {err} entry" if isinstance(err, KeyError) else str(err)
        raise CheckpointError(f"checkpoint metadata {meta_path} is damaged: {missing}") from None
    return meta


class _Shards:
    """Reads the shards of one checkpoint lazily and assembles full tensors by parameter name."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        topo = meta["topology"]
        self.tp, self.pp = topo["tp"], topo["pp"]
        self.ep, self.expert_tp = topo.get("ep", 1), topo.get("expert_tp", 1)
        self._cache: dict[str, dict] = {}

    def shard(self, tp: int, pp: int) -> dict:
        return self._file(_shard_name(tp, pp))

    def expert_shard(self, expert_tp: int, ep: int, pp: int) -> dict:
        return self._file(_expert_shard_name(expert_tp, ep, pp))

    def _file(self, name: str) -> dict:
        if name not in self._cache:
            f = os.path.join(self.path, name)
            if not os.path.exists(f):
                raise CheckpointError(f"checkpoint shard {f} is missing")
            expected = self.meta["files"].get(name)
            if expected is None:
                raise CheckpointError(f"checkpoint shard {f} is not listed in {self.path}/metadata.json")
            size, digest = (expected, None) if isinstance(expected, int) else (expected.get("bytes"), expected.get("sha256"))
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
            except OSError as err:
                raise CheckpointError(f"checkpoint shard {f} cannot be read: {err}") from None
            if len(data) != size:
                raise CheckpointError(
                    f"checkpoint shard {f} is truncated or corrupt: {len(data)} bytes, metadata says {size}")
            if digest is not None and hashlib.sha256(data).hexdigest() != digest:
                raise CheckpointError(
                    f"checkpoint shard {f} is corrupt: its SHA-256 does not match the one in metadata.json "
                    f"(the file changed after it was written)")
            try:
                shard = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                for key in ("params", "meta", "optimizer", "optimizer_step", "rng", "torch_rng"):
                    shard[key]
            except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
                raise CheckpointError(f"checkpoint shard {f} is truncated or corrupt: {err!r}") from None
            self._cache[name] = shard
        return self._cache[name]

    def _locate(self, name: str):
        """The shard files holding parameter ``name``, one per tensor-parallel rank (expert-tp for an expert)."""
        if _is_expert(name):
            for pp in range(self.pp):
                for ep in range(self.ep):
                    if _expert_shard_name(0, ep, pp) in self.meta["files"] and \
                            name in self.expert_shard(0, ep, pp)["params"]:
                        return [self.expert_shard(t, ep, pp) for t in range(self.expert_tp)]
            return None
        for pp in range(self.pp):
            if name in self.shard(0, pp)["params"]:
                return [self.shard(t, pp) for t in range(self.tp)]
        return None

    def full(self, name: str, *, what: str = "param", key: Optional[str] = None) -> Optional[torch.Tensor]:
        """Full tensor of parameter ``name`` (padding rows dropped), or of its optimizer ``key`` state."""
        found = self._locate(name)
        if found is None and name == "head_weight":
            found, name = self._locate("embedding.weight"), "embedding.weight"  # tied: same matrix
        if found is None:
            return None
        meta = found[0]["meta"][name]
        parts = []
        for sh in found:
            if what == "param":
                parts.append(sh["params"][name])
            else:
                st = sh["optimizer"].get(name)
                if st is None or key not in st:
                    return None
                parts.append(st[key])
        full = unshard(parts, dim=meta["split_dim"], partitions=meta.get("partitions", 1),
                       replicas=meta.get("replicas", 1))
        if meta["vocab_rows"] is not None:
            full = full[: meta["vocab_rows"]]
        return full


def _local_slice(full: torch.Tensor, param, tp_size: int, tp_rank: int) -> torch.Tensor:
    rows = getattr(param, "vocab_rows", None)
    if rows is not None:
        padded = param.global_shape[0]
        if full.shape[0] < padded:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    return shard_full(full, dim=getattr(param, "tp_split_dim", None), tp_size=tp_size, tp_rank=tp_rank,
                      partitions=getattr(param, "tp_partitions", 1), replicas=getattr(param, "tp_replicas", 1))


def load_checkpoint(trainer, path: str) -> int:
    """Load the checkpoint at ``path`` (a checkpoint folder, or a folder with ``latest``) into ``trainer``,
    whatever layout it was saved in. Returns the step to continue from. Every defect of the files
    raises :class:`CheckpointError` naming the file; a trainer with a step in progress raises
    RuntimeError (drop the step first). Weights torn by a failed optimizer update are replaced."""
    _check_between_steps(trainer, "load_checkpoint", loading=True)
    path = latest_checkpoint(path)
    try:
        with trainer.full_parameters():               # ZeRO-3: whole while loading, shards refreshed
            step = _load(trainer, path)
        trainer.updating = False                      # a torn update is replaced by whole weights
        return step
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {type(err).__name__}: {err}") from None


def check_checkpoint(path: str, model) -> str:
    """The checkpoint folder ``path`` resolves to, once its metadata is readable and it was saved
    from ``model`` (a :class:`~mlmkit.model.GPTConfig`); :class:`CheckpointError` otherwise. Reads
    one small file and needs no process: drivers call it before any process group exists."""
    path = latest_checkpoint(path)
    _check_model(path, _read_metadata(path), model)
    return path


def checkpoint_step(path: str) -> int:
    """The step the checkpoint at ``path`` (a folder of checkpoints: its newest) resumes from."""
    return _read_metadata(latest_checkpoint(path))["step"]


def _check_model(path: str, meta: dict, model) -> None:
    saved_model = meta["config"]["model"]
    try:   # fill the defaults of fields newer than the checkpoint
        from mlmkit.model.config import GPTConfig

        saved_model = GPTConfig.from_dict(saved_model).to_dict()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}/metadata.json has a model configuration this version cannot "
                              f"read: {err}") from None
    mine = model.to_dict()
    diff = sorted(k for k in set(saved_model) | set(mine) if saved_model.get(k) != mine.get(k))
    if diff:
        details = ", ".join(f"{k}: checkpoint {saved_model.get(k)!r} vs model {mine.get(k)!r}" for k in diff)
        raise CheckpointError(f"checkpoint {path} was saved from another model configuration ({details})")


def _load(trainer, path: str) -> int:
    meta = _read_metadata(path)
    _check_model(path, meta, trainer.config.model)
    shards = _Shards(path, meta)
    g = trainer.groups
    states = {}
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            tp, tp_rank = (g.expert_tp.size, g.expert_tp.rank) if getattr(p, "expert", False) else (g.tp.size, g.coords.tp)
            full = shards.full(name)
            if full is None:
                raise CheckpointError(f"checkpoint {path} has no parameter {name!r}")
            master = shards.full(name, what="optimizer", key="master")
            # A mixed-precision checkpoint's weights are its fp32 masters (its bf16 parameters are
            # them rounded): fp32 parameters take those, bf16 parameters round them again.
            p.copy_(_local_slice(master if master is not None else full, p, tp, tp_rank))
            st = {}
            for key in ("exp_avg", "exp_avg_sq", "master"):
                f = master if key == "master" else shards.full(name, what="optimizer", key=key)
                if f is not None:
                    st[key] = _local_slice(f, p, tp, tp_rank).clone()
            if "master" not in st and full.dtype == torch.float32:
                st["master"] = _local_slice(full, p, tp, tp_rank).clone()   # an fp32 run's weights are its masters
            states[name] = st
    opt_step = shards.shard(0, 0)["optimizer_step"]
    trainer.optimizer.params_loaded()
    if states:
        trainer.optimizer.load_state_by_name(states, opt_step)
    # The grid decides whether the saved random states fit; the experts flag follows the model (and
    # checkpoints written before it existed lack it).
    grid = {k: v for k, v in asdict(trainer.config.topology).items() if k != "experts"}
    saved = {k: v for k, v in meta["topology"].items() if k != "experts"}
    same_layout = saved == grid and meta["config"]["chunks"] == trainer.config.chunks
    if same_layout:
        sh = shards.shard(trainer.groups.coords.tp, trainer.groups.coords.pp)
        states = [tuple(state) for state in sh["rng"]]
        for c, (model, state) in enumerate(zip(trainer.chunks, states)):
            # Written before each chunk had its own streams (every chunk of a rank seeded alike),
            # the checkpoint holds one state for all: a later chunk keeps its own fresh streams
            # rather than repeat the first chunk's masks.
            if c > 0 and all(torch.equal(a, b) for a, b in zip(state, states[0])):
                continue
            model.rng.set_state(state)
        torch.set_rng_state(sh["torch_rng"])
    trainer.step = meta["step"]
    return trainer.step


def export_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint as one full state dict for the serial model ``GPT(config.model)`` (no process
    needed), in its dtype (fp32): a mixed-precision checkpoint gives its fp32 master weights."""
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
        master = shards.full(name, what="optimizer", key="master")     # bf16 runs: the fp32 weights
        out[name] = _local_slice(master if master is not None else full, p, 1, 0).to(p.dtype).clone()
    return out
