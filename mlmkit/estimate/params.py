"""Which parameters each rank holds, in the order the model registers them (pure Python).

Mirrors :class:`mlmkit.model.GPT` exactly (names, local shapes, split dimension, the flags that
decide gradient synchronisation), so that estimates of memory and communication can be exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from mlmkit.model.config import GPTConfig
from mlmkit.topology import Topology

__all__ = ["LocalParam", "stage_layout", "local_parameters"]


@dataclass(frozen=True)
class LocalParam:
    name: str
    numel: int
    split_dim: Optional[int]
    sequence_parallel: bool = False
    shared_embedding: bool = False


def _split_layers(num_layers: int, stages: int, layers_per_stage: Optional[Sequence[int]] = None) -> list[tuple[int, ...]]:
    if layers_per_stage is None:
        base, extra = divmod(num_layers, stages)
        layers_per_stage = [base + (1 if i < extra else 0) for i in range(stages)]
    out, start = [], 0
    for n in layers_per_stage:
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def stage_layout(model: GPTConfig, topology: Topology, *, pp_rank: int, chunks: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None) -> list[dict]:
    """For each chunk of pipeline rank ``pp_rank``: its layers and whether it holds the two ends."""
    p = topology.pp
    layout = _split_layers(model.layers, p * chunks, layers_per_stage)
    return [{"chunk": c, "virtual_stage": c * p + pp_rank, "layers": layout[c * p + pp_rank],
             "pre_process": c * p + pp_rank == 0, "post_process": c * p + pp_rank == p * chunks - 1}
            for c in range(chunks)]


def local_parameters(model: GPTConfig, topology: Topology, *, pp_rank: int, chunks: int = 1,
                     sequence_parallel: bool = False,
                     layers_per_stage: Optional[Sequence[int]] = None) -> list[LocalParam]:
    """The parameters one rank (any TP rank of pipeline rank ``pp_rank``) holds, in registration order."""
    t, h, ffn, sp = topology.tp, model.hidden, model.ffn, sequence_parallel
    vocab = model.padded_vocab(t)
    out: list[LocalParam] = []
    for st in stage_layout(model, topology, pp_rank=pp_rank, chunks=chunks, layers_per_stage=layers_per_stage):
        if st["pre_process"]:
            out.append(LocalParam("embedding.weight", vocab // t * h, 0))
            out.append(LocalParam("position", model.seq_len * h, None, sp))
        for i in st["layers"]:
            pre = f"layers.{i}"
            out += [
                LocalParam(f"{pre}.ln1.weight", h, None, sp), LocalParam(f"{pre}.ln1.bias", h, None, sp),
                LocalParam(f"{pre}.attn.qkv.weight", 3 * h // t * h, 0), LocalParam(f"{pre}.attn.qkv.bias", 3 * h // t, 0),
                LocalParam(f"{pre}.attn.proj.weight", h * (h // t), 1), LocalParam(f"{pre}.attn.proj.bias", h, None, sp),
                LocalParam(f"{pre}.ln2.weight", h, None, sp), LocalParam(f"{pre}.ln2.bias", h, None, sp),
                LocalParam(f"{pre}.mlp.fc1.weight", ffn // t * h, 0), LocalParam(f"{pre}.mlp.fc1.bias", ffn // t, 0),
                LocalParam(f"{pre}.mlp.fc2.weight", h * (ffn // t), 1), LocalParam(f"{pre}.mlp.fc2.bias", h, None, sp),
            ]
        if st["post_process"]:
            out += [LocalParam("final_ln.weight", h, None, sp), LocalParam("final_ln.bias", h, None, sp)]
            if not (model.tie_embeddings and st["pre_process"]):
                out.append(LocalParam("head_weight", vocab // t * h, 0, False, model.tie_embeddings))
    return out
