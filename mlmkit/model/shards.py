"""Shard inspection: what each rank holds of each parameter, and gathering shards back to full size."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mlmkit.distributed import CommGroup

__all__ = ["shard_table", "gather_full"]


def shard_table(model: nn.Module, *, rank: Optional[int] = None):
    """One row per parameter of ``model`` on this rank, as a pandas DataFrame.

    Columns: ``name``, ``local_shape``, ``global_shape``, ``split_dim`` (``<NA>``: replicated on every
    TP rank), ``partitions`` (blocks of the split dimension split separately, e.g. SwiGLU's gate and
    up), ``replicas`` (TP ranks holding the same shard, e.g. key/value heads when tp > kv_heads),
    ``tp_rank``/``tp_size``, ``sequence_parallel`` (gradient summed over TP after backward),
    ``numel``, ``dtype`` and ``bytes`` held here.
    """
    import pandas as pd

    tp = _tp_group(model)
    rows = []
    for name, p in model.named_parameters():
        rows.append({
            "rank": rank if rank is not None else (tp.global_rank if tp is not None else 0),
            "name": name,
            "local_shape": tuple(p.shape),
            "global_shape": tuple(getattr(p, "global_shape", tuple(p.shape))),
            "split_dim": getattr(p, "tp_split_dim", None),
            "partitions": getattr(p, "tp_partitions", 1),
            "replicas": getattr(p, "tp_replicas", 1),
            "tp_rank": tp.rank if tp is not None else 0,
            "tp_size": tp.size if tp is not None else 1,
            "sequence_parallel": bool(getattr(p, "sequence_parallel", False)),
            "numel": p.numel(),
            "dtype": str(p.dtype).replace("torch.", ""),
            "bytes": p.numel() * p.element_size(),
        })
    df = pd.DataFrame(rows)
    df["split_dim"] = df["split_dim"].astype("Int64")  # <NA> = replicated on every TP rank
    return df


def _tp_group(model: nn.Module) -> Optional[CommGroup]:
    """The tensor-parallel group of ``model``: its own ``tp``, else the first submodule's (a
    ModuleDict of layers, an MLP...)."""
    for m in model.modules():
        tp = getattr(m, "tp", None)
        if isinstance(tp, CommGroup):
            return tp
    return None


def gather_full(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered over the TP group to its full shape.

    Collective over the model's TP group (an expert's parameters: over its expert-tp group). Vocabulary padding rows are dropped, so the result has the
    same shapes whatever the TP degree (compare it with the serial model's ``named_parameters``).
    A parameter without a gradient reads as zeros.

    Raises:
        RuntimeError: a ZeRO-3 parameter read while it is freed (between its uses the whole tensor
            has no memory: read it inside ``with trainer.full_parameters():``), or the gradient of a
            ZeRO-2/3 parameter after the data-parallel reduction (each rank then holds only its
            shard, in the optimizer).
    """
    from mlmkit.tensor_parallel.layers import param_grad, unshard

    default = _tp_group(model) or CommGroup.single("tp")
    out = {}
    for name, p, tp in _params_with_groups(model, default):
        stage = getattr(p, "zero_stage", 0)
        if not grads and p.untyped_storage().nbytes() < (p.storage_offset() + p.numel()) * p.element_size():
            # Reading it would read freed memory (a crash, or garbage).
            raise RuntimeError(f"gather_full: parameter {name!r} is sharded by ZeRO-{stage} and not gathered "
                               f"now (only its shard has memory between uses): read it inside "
                               f"`with trainer.full_parameters():`")
        t = param_grad(p) if grads else p.detach()
        if t is None and getattr(p, "grad_reduced", False):
            raise RuntimeError(f"gather_full: the gradient of {name!r} was reduce-scattered by ZeRO-{stage} (each "
                               f"rank keeps only its shard, in the optimizer); read whole gradients before "
                               f"the data-parallel reduction, or use zero <= 1")
        if t is None:
            t = torch.zeros_like(p)
        t = t.detach()
        dim = getattr(p, "tp_split_dim", None)
        if dim is not None and tp.size > 1:
            gathered = tp.all_gather(t.contiguous(), dim=dim, site="gather_full")
            t = unshard(gathered.chunk(tp.size, dim=dim), dim=dim, partitions=getattr(p, "tp_partitions", 1),
                        replicas=getattr(p, "tp_replicas", 1))
        rows = getattr(p, "vocab_rows", None)
        if rows is not None:
            t = t[:rows]
        out[name] = t.clone()
    return out


def _params_with_groups(module: nn.Module, group: CommGroup, prefix: str = ""):
    # (name, parameter, the tensor-parallel group it is split over): the nearest module's own ``tp``
    # (an expert's linear layers are split over the expert-tp group, not the model's tp).
    own = getattr(module, "tp", None)
    group = own if isinstance(own, CommGroup) else group
    for name, p in module.named_parameters(recurse=False):
        yield prefix + name, p, group
    for child_name, child in module.named_children():
        yield from _params_with_groups(child, group, prefix + child_name + ".")
