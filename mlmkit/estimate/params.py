"""Which parameters each rank holds, in the order the model registers them (pure Python).

Mirrors :class:`mlmkit.model.GPT` exactly (names, local shapes, split dimension, the flags that
decide gradient synchronisation), so that estimates of memory and communication can be exact.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

from mlmkit.model.config import GPTConfig, split_layers
from mlmkit.scalars import plain_bool
from mlmkit.topology import Topology

__all__ = ["LocalParam", "check_estimate", "local_parameters", "moe_idle_experts", "moe_kept_by_expert",
           "moe_parameter_counts", "shard_unit_sizes", "stage_layout", "total_parameters"]


@dataclass(frozen=True)
class LocalParam:
    name: str
    numel: int
    split_dim: Optional[int]
    sequence_parallel: bool = False
    shared_embedding: bool = False
    replicas: int = 1          # TP ranks holding this same shard (key/value heads when tp > kv_heads)
    expert: bool = False       # an expert's parameter: split over expert-tp, reduced over expert-dp
    tied_embedding: bool = False   # a copy of the tied word embedding: its own dp bucket and ZeRO-1 shard


def stage_layout(model: GPTConfig, topology: Topology, *, pp_rank: int, chunks: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None, placement: str = "loop") -> list[dict]:
    """For each chunk of pipeline rank ``pp_rank``: its virtual stage (``placement`` "loop" or
    "v", see :mod:`mlmkit.pipeline.schedule`), its layers and whether it holds the two ends."""
    p = topology.pp
    layout = split_layers(model.layers, p * chunks, layers_per_stage)
    out = []
    for c in range(chunks):
        vs = (pp_rank if c == 0 else 2 * p - 1 - pp_rank) if placement == "v" else c * p + pp_rank
        out.append({"chunk": c, "virtual_stage": vs, "layers": layout[vs], "pre_process": vs == 0,
                    "post_process": vs == p * chunks - 1})
    return out


def local_parameters(model: GPTConfig, topology: Topology, *, pp_rank: int, chunks: int = 1,
                     sequence_parallel: bool = False, layers_per_stage: Optional[Sequence[int]] = None,
                     only_chunk: Optional[int] = None, placement: str = "loop", ep_rank: int = 0) -> list[LocalParam]:
    """The parameters one rank (any TP rank of pipeline rank ``pp_rank``; expert-parallel rank
    ``ep_rank``) holds, in registration order (per chunk: the module's own parameters, then the
    embedding, the layers, the final norm; a mixture of experts: router, local experts, shared expert)."""
    t, h, ffn, sp, d = topology.tp, model.hidden, model.ffn, sequence_parallel, model.head_dim
    vocab = model.padded_vocab(t)
    bias = model.bias

    def norm(name: str) -> list[LocalParam]:
        out = [LocalParam(f"{name}.weight", h, None, sp)]
        if model.norm == "layernorm" and bias:
            out.append(LocalParam(f"{name}.bias", h, None, sp))
        return out

    def column(name: str, rows: int, replicas: int = 1) -> list[LocalParam]:
        local = rows // (t // replicas)
        out = [LocalParam(f"{name}.weight", local * h, 0, replicas=replicas)]
        if bias:
            out.append(LocalParam(f"{name}.bias", local, 0, replicas=replicas))
        return out

    def row(name: str, cols: int) -> list[LocalParam]:
        out = [LocalParam(f"{name}.weight", h * (cols // t), 1)]
        if bias:
            out.append(LocalParam(f"{name}.bias", h, None, sp))
        return out

    out: list[LocalParam] = []
    for st in stage_layout(model, topology, pp_rank=pp_rank, chunks=chunks, layers_per_stage=layers_per_stage,
                           placement=placement):
        if only_chunk is not None and st["chunk"] != only_chunk:
            continue
        pre_p, post_p = st["pre_process"], st["post_process"]
        if pre_p and model.position == "learned":
            out.append(LocalParam("position", model.seq_len * h, None, sp))
        if post_p and not (model.tie_embeddings and pre_p):
            # shared_embedding: a copy of the tied word embedding, not counted twice in the gradient norm
            out.append(LocalParam("head_weight", vocab // t * h, 0, False, model.tie_embeddings,
                                  tied_embedding=model.tie_embeddings))
        if pre_p:
            out.append(LocalParam("embedding.weight", vocab // t * h, 0, tied_embedding=model.tie_embeddings))
        for i in st["layers"]:
            pre = f"layers.{i}"
            out += norm(f"{pre}.ln1")
            if model.grouped:
                out += column(f"{pre}.attn.q", model.heads * d)
                out += column(f"{pre}.attn.kv", 2 * model.num_kv_heads * d, model.kv_replicas(t))
            else:
                out += column(f"{pre}.attn.qkv", 3 * h)
            out += row(f"{pre}.attn.proj", h)
            out += norm(f"{pre}.ln2")
            if model.moe:
                out += _moe_parameters(model, topology, pre=f"{pre}.mlp", ep_rank=ep_rank, sp=sp)
                if model.moe_shared_ffn_hidden:
                    out += _mlp(column, row, model, f"{pre}.mlp.shared", model.moe_shared_ffn_hidden)
            else:
                out += _mlp(column, row, model, f"{pre}.mlp", ffn)
        if post_p:
            out += norm("final_ln")
    return out


def _mlp(column, row, model: GPTConfig, name: str, ffn: int) -> list[LocalParam]:
    if model.mlp == "gelu":
        out = column(f"{name}.fc1", ffn)
    elif model.gate_up_fused:
        out = column(f"{name}.fc1", 2 * ffn)
    else:
        out = column(f"{name}.gate", ffn) + column(f"{name}.up", ffn)
    return out + row(f"{name}.fc2", ffn)


def _moe_parameters(model: GPTConfig, topology: Topology, *, pre: str, ep_rank: int, sp: bool) -> list[LocalParam]:
    # router (dense, replicated; summed over tp with SP), then this ep rank's experts split over expert-tp
    h, E, f, et = model.hidden, model.experts, model.moe_ffn, topology.expert_tp
    out = [LocalParam(f"{pre}.router.weight", E * h, None, sp)]
    rows = 2 * f if model.mlp == "swiglu" else f
    local = E // topology.ep
    for e in range(ep_rank * local, (ep_rank + 1) * local):
        name = f"{pre}.experts.{e}"
        out.append(LocalParam(f"{name}.fc1.weight", rows // et * h, 0, expert=True))
        if model.bias:
            out.append(LocalParam(f"{name}.fc1.bias", rows // et, 0, expert=True))
        out.append(LocalParam(f"{name}.fc2.weight", h * (f // et), 1, expert=True))
        if model.bias:
            out.append(LocalParam(f"{name}.fc2.bias", h, None, expert=True))
    return out


def moe_kept_by_expert(model: GPTConfig, tokens: float) -> list[float]:
    """Assignments each expert keeps from one rank's ``tokens`` tokens (a list over the experts).

    With ``moe_force_uniform`` exactly what its round-robin routing
    (:func:`mlmkit.moe.routing.uniform_indices`) sends: ``tokens * top_k // experts`` to every
    expert and one more to each of the first ``tokens * top_k mod experts`` (the same on every rank,
    which numbers its own tokens from 0), so an expert may get none. Otherwise the mean of an even
    routing, ``tokens * top_k / experts`` (a fraction where it does not divide). With
    ``moe_capacity_factor`` each is capped at the capacity ``ceil(factor * tokens * top_k /
    experts)`` (the rule of :func:`mlmkit.moe.routing.capacity`); the rest are dropped."""
    Ex, n = model.experts, tokens * model.top_k
    if model.moe_force_uniform:
        base, extra = divmod(int(round(n)), Ex)
        counts = [float(base + (e < extra)) for e in range(Ex)]
    else:
        counts = [n / Ex] * Ex
    if model.moe_capacity_factor is not None:
        cap = math.ceil(model.moe_capacity_factor * tokens * model.top_k / Ex)
        counts = [min(c, cap) for c in counts]
    return counts


def moe_idle_experts(model: GPTConfig, tokens: float) -> set[int]:
    """Experts that no token reaches when every rank routes ``tokens`` tokens per microbatch: with
    ``moe_force_uniform`` and ``tokens * top_k < experts`` the last ones (they run no forward and get
    no gradient of their own); otherwise none are assumed."""
    if not model.moe_force_uniform:
        return set()
    return {e for e, c in enumerate(moe_kept_by_expert(model, tokens)) if c == 0}


def moe_parameter_counts(model: GPTConfig) -> dict:
    """Parameters of the whole model: ``total``, ``active`` per token (top_k of the experts of each
    layer, everything else), ``experts`` (all expert weights) and ``dense`` (the rest)."""
    total = total_parameters(model)
    if not model.moe:
        return {"total": total, "active": total, "experts": 0, "dense": total}
    per_expert = sum(q.numel for q in _moe_parameters(model, Topology(), pre="x", ep_rank=0, sp=False)
                     if q.expert) // model.experts
    experts = per_expert * model.experts * model.layers
    return {"total": total, "active": total - experts + per_expert * model.top_k * model.layers,
            "experts": experts, "dense": total - experts}


def total_parameters(model: GPTConfig) -> int:
    """Parameters of the whole (serial) model, the tied output head counted once."""
    return sum(q.numel for q in local_parameters(model, Topology(), pp_rank=0))


def shard_unit_sizes(model: GPTConfig, topology: Topology, *, pp_rank: int, chunks: int = 1,
                     sequence_parallel: bool = False, layers_per_stage: Optional[Sequence[int]] = None,
                     placement: str = "loop") -> list[dict]:
    """The ZeRO-2/3 units of a rank (:func:`mlmkit.data_parallel.zero.shard_units`): per chunk its
    root (embedding, final norm, head; absent when the chunk has none), its copy of a tied word
    embedding (a root unit of its own) and each layer, with their elements:
    ``{"chunk", "kind": "root" | "layer", "numel", "pre_process"}`` (a root also has
    ``post_numel``: its elements used after the layers: final norm, head)."""
    out = []
    for st in stage_layout(model, topology, pp_rank=pp_rank, chunks=chunks, layers_per_stage=layers_per_stage,
                           placement=placement):
        mine = local_parameters(model, topology, pp_rank=pp_rank, chunks=chunks, sequence_parallel=sequence_parallel,
                                layers_per_stage=layers_per_stage, only_chunk=st["chunk"], placement=placement)
        rest = [q for q in mine if not q.name.startswith("layers.")]
        for root in ([q for q in rest if not q.tied_embedding], [q for q in rest if q.tied_embedding]):
            # used only after the layers: their gradients exist once the backward reaches the layers
            # (a tied embedding used at both ends gets its gradient once, at the end, summed)
            post = [q for q in root if q.name.startswith("final_ln.") or q.name == "head_weight"]
            if root:
                out.append({"chunk": st["chunk"], "kind": "root", "numel": sum(q.numel for q in root),
                            "post_numel": sum(q.numel for q in post), "pre_process": st["pre_process"]})
        for i in st["layers"]:
            out.append({"chunk": st["chunk"], "kind": "layer", "pre_process": st["pre_process"],
                        "numel": sum(q.numel for q in mine if q.name.startswith(f"layers.{i}."))})
    return out


def check_estimate(model: GPTConfig, topology: Topology, *, micro_batch_size: object, microbatches: object,
                   chunks: object = 1, sequence_parallel: bool = False, zero: object = None, prefetch: object = 0,
                   recompute: object = "none", flags: Optional[dict] = None, what: str = "estimate") -> None:
    """ValueError naming what an estimate cannot be made for: a micro-batch size or microbatch count
    that is not a positive integer, a ZeRO stage other than 0-3 (or None) or a prefetch other than 0
    or 1, a recomputation other than "none", "selective", "full" (or a bool), a switch in ``flags``
    (name: value) that is not a bool, or a model that this topology cannot split (the trainer's own
    check, :meth:`GPTConfig.check_parallel`): such numbers would describe no run."""
    # sequence_parallel="no" was estimated with sequence parallelism (a truthy string), recompute="ful"
    # without recomputation
    for name, value in {"sequence_parallel": sequence_parallel, **(flags or {})}.items():
        if not isinstance(plain_bool(value), bool):      # numpy's bools too (a DataFrame row's)
            raise ValueError(f"{what}: {name}={value!r} must be True or False")
    if not (isinstance(plain_bool(recompute), bool) or recompute is None
            or (isinstance(recompute, str) and recompute in ("none", "selective", "full"))):
        raise ValueError(f"{what}: recompute={recompute!r}; expected 'none', 'selective' or 'full' (or a bool)")
    for name, value in (("micro_batch_size", micro_batch_size), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{what}: {name}={value!r} must be an integer >= 1")
    # zero=-1 or 5 was estimated as some stage, True as stage 1: numbers of no run
    if zero is not None and (isinstance(zero, bool) or not isinstance(zero, numbers.Integral) or zero not in (0, 1, 2, 3)):
        raise ValueError(f"{what}: zero={zero!r} must be a ZeRO stage 0, 1, 2 or 3 (or None: zero1 decides)")
    if zero is not None and zero >= 2 and model.moe:
        # mlmkit shards dense models only (TrainConfig refuses this): these numbers would be of no run
        raise ValueError(f"{what}: zero={zero} shards dense models only (experts={model.experts}); use zero=1 with a "
                         f"mixture of experts")
    if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch not in (0, 1):
        raise ValueError(f"{what}: prefetch={prefetch!r} must be 0 or 1 (ZeRO-3's layers gathered ahead)")
    model.check_parallel(tp=topology.tp, pp=topology.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                         cp=topology.cp, ep=topology.ep, expert_tp=topology.expert_tp)
