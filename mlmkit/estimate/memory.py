"""Memory per rank, estimated in pure Python: parameters, gradients, optimizer state, activations.

Model state (bytes per parameter, Megatron-LM's accounting, "distributed optimizer" docs):

- mixed precision (``precision="bf16"``): 2 (bf16 parameter) + 4 (fp32 gradient) + 12 (fp32 master
  copy, Adam's exp_avg and exp_avg_sq) = **18**; with the distributed optimizer (ZeRO-1) over ``d``
  replicas the 12 are split: **6 + 12/d**.
- mlmkit's fp32 training (``precision="fp32"``): 4 + 4 + 8 (exp_avg, exp_avg_sq; the parameter
  itself is the master) = 16; with ZeRO-1, 4 + 4 + 12/d (the fp32 shard copy plus its two states,
  on ``ceil(N/d)`` elements).

Activations per Transformer layer and microbatch (Korthikanti et al. 2022, section 4; ``s``
sequence, ``b`` microbatch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree), with 2-byte
activations and 1-byte dropout masks (``implementation="megatron"``):

- no parallelism: ``sbh (34 + 5as/h)``
- tensor parallelism: ``sbh (10 + 24/t + 5as/(ht))``
- tensor + sequence parallelism: ``sbh/t (34 + 5as/h)``
- full recomputation: ``2sbh`` (``2sbh/t`` with sequence parallelism)

The same terms are summed per saved tensor, so ``implementation="mlmkit"`` describes what this
library's layers actually save (each a systematic difference from the paper, measured by the
saved-tensor hooks of :mod:`mlmkit.trace.memory`):

- activations are fp32 (4 bytes) and a dropout mask is a float tensor (4 bytes); with dropout 0 no
  mask or dropped copy is stored at all;
- with sequence parallelism, the inputs of the QKV and fc1 linears are stored all-gathered
  (``sbh``, not ``sbh/t``: Megatron-LM stores the split input and gathers it again in backward);
- LayerNorm also stores its mean and reciprocal std (``2sb`` per LayerNorm), the attention stores
  its causal mask (``s^2`` bytes), and the first and last stages hold the embedding's indices and
  the loss's softmax over the (local) vocabulary.

The peak per rank replays the schedule's compute order: a microbatch's activations are held from
its forward until its last backward action (W when backward is split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from mlmkit.estimate.params import local_parameters, stage_layout
from mlmkit.model.config import GPTConfig
from mlmkit.pipeline.schedule import make_schedule
from mlmkit.topology import Topology

__all__ = ["PRECISIONS", "Precision", "activation_bytes_per_layer", "bytes_per_parameter", "estimate_memory"]


@dataclass(frozen=True)
class Precision:
    """Bytes of each kind of tensor."""

    name: str
    param: int
    grad: int
    master: int      # fp32 master copy kept by the optimizer (0: the parameter is the master)
    state: int       # each of Adam's two moments
    activation: int
    mask: int        # one dropout-mask element


PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, master=0, state=4, activation=4, mask=4),
    "bf16": Precision("bf16", param=2, grad=4, master=4, state=4, activation=2, mask=1),
}


def _precision(p) -> Precision:
    if isinstance(p, Precision):
        return p
    if p not in PRECISIONS:
        raise ValueError(f"unknown precision {p!r}; choose one of {sorted(PRECISIONS)}")
    return PRECISIONS[p]


def bytes_per_parameter(*, precision="bf16", zero1: bool = False, dp: int = 1) -> float:
    """Model-state bytes per parameter: 18 (bf16), or 6 + 12/d with ZeRO-1 (Megatron-LM's figures)."""
    pr = _precision(precision)
    optimizer = 2 * pr.state + (pr.master if pr.master else (pr.param if zero1 else 0))
    return pr.param + pr.grad + (optimizer / dp if zero1 else optimizer)


def activation_bytes_per_layer(*, s: int, b: int, h: int, a: int, ffn: Optional[int] = None, t: int = 1,
                               sequence_parallel: bool = False, recompute: bool = False, dropout: bool = True,
                               precision="bf16", implementation: str = "megatron") -> float:
    """Bytes one Transformer layer keeps for backward, per microbatch (module docstring)."""
    if implementation not in ("megatron", "mlmkit"):
        raise ValueError(f"implementation={implementation!r}: expected 'megatron' or 'mlmkit'")
    pr = _precision(precision)
    E, M = pr.activation, pr.mask
    ffn = 4 * h if ffn is None else ffn
    sp = sequence_parallel and t > 1
    seq = (s * b * h / t) if sp else s * b * h          # replicated region, split along s with SP
    if recompute:
        return E * seq
    mine = implementation == "mlmkit"
    gathered_in = (s * b * h) if (mine or not sp) else s * b * h / t    # QKV / fc1 inputs
    split = s * b * h / t                                              # tensor-parallel region
    attn = a * s * s * b / t
    total = E * (2 * seq + 2 * gathered_in)                 # ln1/ln2 inputs, qkv/fc1 inputs
    total += E * (3 * split + split)                        # Q, K, V; projection input
    total += E * 2 * s * b * ffn / t                        # GELU input, fc2 input
    total += E * attn                                       # softmax output
    if mine:
        total += 2 * 4 * (s * b / t if sp else s * b)       # LayerNorm mean and rstd (fp32)
        total += s * s                                      # causal mask (bool)
    if dropout:
        if mine:
            total += (E + M) * attn                         # mask and dropped probabilities
            total += 2 * (E + M) * seq                      # residual dropouts: mask and saved input
        else:
            total += (E + M) * attn                         # dropout output (2) and mask (1)
            total += 2 * M * seq                            # two residual-dropout masks
    return total


def _stage_extra(model: GPTConfig, *, s: int, b: int, t: int, sp: bool, pre: bool, post: bool, pr: Precision) -> float:
    # mlmkit's first/last-stage activations outside the layers (see module docstring).
    E, h = pr.activation, model.hidden
    extra = 0.0
    if pre:
        extra += 8 * b * s + b * s                           # embedding indices (int64), out-of-range mask
        if model.dropout:
            extra += (E + pr.mask) * (s * b * h / t if sp else s * b * h)
    if post:
        seq = s * b * h / t if sp else s * b * h
        extra += E * seq + 2 * 4 * (s * b / t if sp else s * b)   # final LayerNorm input and stats
        extra += E * s * b * h                                    # head input (gathered with SP)
        extra += E * s * b * model.padded_vocab(t) / t            # softmax over the local vocabulary
        extra += 8 * s * b + 2 * s * b                            # targets (int64), two bool masks
    return extra


def estimate_memory(model: GPTConfig, topology: Topology, *, micro_batch_size: int, microbatches: int,
                    schedule: str = "1f1b", chunks: int = 1, sequence_parallel: bool = False,
                    recompute: bool = False, zero1: bool = False, precision="fp32",
                    implementation: str = "mlmkit", layers_per_stage: Optional[Sequence[int]] = None):
    """Estimated bytes per rank as a DataFrame indexed by rank.

    Columns: ``parameters``, ``gradients``, ``optimizer``, ``activations`` (peak over the step),
    ``total``.
    """
    import pandas as pd

    pr = _precision(precision)
    sched = make_schedule(schedule, stages=topology.pp, microbatches=microbatches, chunks=chunks, layers=model.layers)
    s, b, t = model.seq_len, micro_batch_size, topology.tp
    sp = sequence_parallel and t > 1
    rows = []
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        params = local_parameters(model, topology, pp_rank=c.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                                  layers_per_stage=layers_per_stage)
        n = sum(p.numel for p in params)
        if zero1:
            shard = -(-n // topology.dp)
            optimizer = shard * (2 * pr.state + (pr.master or pr.param))
        else:
            optimizer = n * (2 * pr.state + pr.master)
        per_chunk = []
        for st in stage_layout(model, topology, pp_rank=c.pp, chunks=chunks, layers_per_stage=layers_per_stage):
            layer = activation_bytes_per_layer(s=s, b=b, h=model.hidden, a=model.heads, ffn=model.ffn, t=t,
                                               sequence_parallel=sp, recompute=recompute,
                                               dropout=model.dropout > 0, precision=pr, implementation=implementation)
            extra = _stage_extra(model, s=s, b=b, t=t, sp=sp, pre=st["pre_process"], post=st["post_process"], pr=pr) \
                if implementation == "mlmkit" else 0.0
            per_chunk.append(len(st["layers"]) * layer + extra)
        last = "W" if sched.split_backward else "B"
        held = peak = 0.0
        for act in sched.compute_actions(c.pp):
            if act.kind == "F":
                held += per_chunk[act.chunk]
                peak = max(peak, held)
            elif act.kind == last:
                held -= per_chunk[act.chunk]
        rows.append({"rank": rank, "parameters": n * pr.param, "gradients": n * pr.grad, "optimizer": optimizer,
                     "activations": peak})
    df = pd.DataFrame(rows).set_index("rank")
    df["total"] = df.sum(axis=1)
    return df
