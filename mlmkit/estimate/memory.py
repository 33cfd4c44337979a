"""Memory per rank, estimated in pure Python: parameters, gradients, optimizer state, activations.

Model state (bytes per parameter, Megatron-LM's accounting, "distributed optimizer" docs):

- mixed precision (``precision="bf16"``): 2 (bf16 parameter) + 4 (fp32 gradient) + 12 (fp32 master
  copy, Adam's exp_avg and exp_avg_sq) = **18**; with the distributed optimizer (ZeRO-1) over ``d``
  replicas the 12 are split: **6 + 12/d**.
- fp32 training (``precision="fp32"``): 4 + 4 + 8 (exp_avg, exp_avg_sq; the parameter itself is
  the master) = 16; with ZeRO-1, 4 + 4 + 12/d (the fp32 shard copy plus its two states, on
  ``ceil(N/d)`` elements).
- ZeRO-2 shards the gradients too (bf16 2 + 16/d), ZeRO-3 everything (18/d; fp32 16/d), unit by unit
  (:mod:`mlmkit.data_parallel.zero`); ZeRO-3 adds the parameters gathered at a time (a chunk's
  root and ``1 + prefetch`` layers). :func:`bytes_per_parameter` gives each stage's figure.

Activations per Transformer layer and microbatch (Korthikanti et al. 2022, section 4; ``s``
sequence, ``b`` microbatch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree), with 2-byte
activations and 1-byte dropout masks (``implementation="megatron"``):

- no parallelism: ``sbh (34 + 5as/h)``
- tensor parallelism: ``sbh (10 + 24/t + 5as/(ht))``
- tensor + sequence parallelism: ``sbh/t (34 + 5as/h)``
- selective recomputation (the attention core: QK^T, softmax, dropout, attention over V) drops
  the ``5as/h`` term: ``34 sbh/t`` with sequence parallelism (section 5);
- full recomputation: ``2sbh`` (``2sbh/t`` with sequence parallelism).

Grouped-query attention shrinks the key and value terms by ``kv_heads/a``, and the MLP terms follow
``ffn`` (SwiGLU keeps gate, up, their activation and product: ``8 sb ffn`` bytes against GELU's
``4 sb ffn``).

``implementation="mlmkit"`` sums what this library's blocks actually save (each a systematic
difference from the paper, measured by the saved-tensor hooks of :mod:`mlmkit.trace.memory`):

- activations are the training dtype (4 bytes in fp32, 2 in bf16) and a dropout mask is a tensor
  of that dtype; with dropout 0 no mask or dropped copy is stored at all;
- with sequence parallelism, the inputs of the column-parallel linears are stored all-gathered
  (``sbh``, not ``sbh/t``: Megatron-LM stores the split input and gathers it again in backward);
- LayerNorm stores its mean and reciprocal std (activation dtype), RMSNorm its reciprocal rms in
  fp32; rotary positions keep their fp32 cos and sin tables (once per stage) and the rotated
  queries and keys;
- attention through ``scaled_dot_product_attention`` (flash kernels; ``attention="sdpa"`` without
  dropout) keeps its output and an fp32 log-sum-exp per query, no ``s x s`` scores; the eager path
  keeps the causal mask (``s^2`` bytes) and the fp32 softmax (plus its bf16 copy in bf16), and with
  grouped-query heads the keys and values repeated for every query head;
- the first and last stages hold the embedding's indices and the loss's fp32 softmax over the
  (local) vocabulary; where a rank's slice of the vocabulary has padded columns (a vocabulary
  padded to ``make_vocab_size_divisible_by`` times tp), the loss also keeps their bool mask
  (``V/t`` bytes per microbatch);
- context parallelism (cp): every term counts this rank's ``s/cp`` tokens; ring attention keeps,
  like flash kernels, no scores but an fp32 log-sum-exp per query, plus its own output (the
  projection's input is a reordered copy, unless the reordering only moves size-1 dimensions: with
  one head per tp rank the projection keeps a view of the output under a split backward, and with
  micro-batch size 1 also under torch's linear); ZeRO-1 shards over the ``dp x cp`` replicas.

The peak per rank replays the schedule's compute order: a microbatch's activations are held from
its forward until its backward; with a split backward (zero-bubble schedules) B frees them but keeps
every linear layer's input and output gradient until W (:func:`weight_grad_bytes_per_layer`). Inside
a split backward the walk keeps some of those before it frees what they replace, a rise above both
ends of the action (:func:`_split_backward_rise`; with full recomputation, every layer's tensors
before the chunk's first checkpointed input). Like :class:`mlmkit.trace.memory.MemoryTracker`, the
replay does not count the tensors a recomputation re-creates during backward (one layer's at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mlmkit.estimate.params import (check_estimate, local_parameters, moe_idle_experts, moe_kept_by_expert,
                                    shard_unit_sizes, stage_layout)
from mlmkit.model.config import GPTConfig
from mlmkit.pipeline.schedule import Schedule, make_schedule
from mlmkit.pipeline.validate import validate
from mlmkit.topology import Topology

__all__ = ["PRECISIONS", "Precision", "activation_bytes_per_layer", "bytes_per_parameter", "estimate_memory",
           "estimate_train_memory", "moe_activation_bytes", "weight_grad_bytes_per_layer"]


@dataclass(frozen=True)
class Precision:
    """Bytes of each kind of tensor."""

    name: str
    param: int
    grad: int
    master: int      # fp32 master copy kept by the optimizer (0: the parameter is the master)
    state: int       # each of Adam's two moments
    activation: int
    mask: int        # one dropout-mask element (Megatron-LM's byte masks; mlmkit's are activations)


PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, master=0, state=4, activation=4, mask=4),
    "bf16": Precision("bf16", param=2, grad=4, master=4, state=4, activation=2, mask=1),
}


def _precision(p) -> Precision:
    if isinstance(p, Precision):
        return p
    if not isinstance(p, str) or p not in PRECISIONS:
        raise ValueError(f"unknown precision {p!r}; choose one of {sorted(PRECISIONS)}")
    return PRECISIONS[p]


def _recompute(recompute: Union[bool, str]) -> str:
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective' or 'full'")
    return recompute


def bytes_per_parameter(*, precision="bf16", zero1: bool = False, dp: int = 1, zero: Optional[int] = None) -> float:
    """Model-state bytes per parameter in the steady state of each ZeRO stage (``zero``; ``zero1=True``
    is 1) over ``dp`` replicas. bf16 (Megatron-LM's count, fp32 gradients): 18; ZeRO-1 6 + 12/d;
    ZeRO-2 2 + 16/d; ZeRO-3 18/d (the ZeRO paper's 2 + 2 + 12 = 16 with fp16 gradients). fp32: 16;
    4 + 4 + 12/d (an fp32 shard copy); 4 + 16/d; 16/d (the master shard is the parameter shard).
    mlmkit reduces gradients once per step, so during the backward passes they are whole (see
    :mod:`mlmkit.data_parallel.zero`)."""
    pr = _precision(precision)
    stage = (1 if zero1 else 0) if zero is None else zero
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"bytes_per_parameter: zero={stage!r} must be 0, 1, 2 or 3")
    if stage == 0:
        return pr.param + pr.grad + 2 * pr.state + pr.master
    if stage == 3:
        return (pr.param + pr.grad + 2 * pr.state + pr.master) / dp
    optimizer = 2 * pr.state + (pr.master or pr.param)          # the shard keeps its own fp32 copy
    return pr.param + (optimizer / dp if stage == 1 else (pr.grad + optimizer) / dp) + (pr.grad if stage == 1 else 0)


def activation_bytes_per_layer(*, s: int, b: int, h: int, a: int, ffn: Optional[int] = None, t: int = 1,
                               sequence_parallel: bool = False, recompute: Union[bool, str] = False,
                               dropout: bool = True, precision="bf16", implementation: str = "megatron",
                               kv_heads: Optional[int] = None, mlp: str = "gelu", norm: str = "layernorm",
                               rope: bool = False, attention: str = "eager", moe: Optional[GPTConfig] = None,
                               ep: int = 1, expert_tp: int = 1, ep_rank: int = 0,
                               split_backward: bool = False) -> float:
    """Bytes one Transformer layer keeps for backward, per microbatch (module docstring).

    ``moe``: the model, when its MLP is a mixture of experts: with ``implementation="mlmkit"``
    :func:`moe_activation_bytes` over ``ep`` x ``expert_tp`` ranks, for a rank of expert-parallel rank
    ``ep_rank``; with ``"megatron"`` the experts' ``top_k`` rows per token (routed evenly) replace the
    dense MLP's terms. ``split_backward``: the schedule splits backward (zero-bubble), whose linear
    layers keep their input as it comes (see the ring's output below).
    ``attention``: "eager" (the paper's accounting; the softmax scores are kept), "sdpa"
    (``implementation="mlmkit"`` only: flash kernels keep no ``s x s`` scores when there is no
    attention dropout) or "ring" (ring attention under context parallelism: like flash, plus its
    output; ``s`` is then this rank's ``s / cp`` tokens). ``kv_heads``, ``mlp``, ``norm`` and ``rope`` select the blocks of
    :class:`~mlmkit.model.config.GPTConfig`.
    """
    if implementation not in ("megatron", "mlmkit"):
        raise ValueError(f"implementation={implementation!r}: expected 'megatron' or 'mlmkit'")
    pr = _precision(precision)
    recompute = _recompute(recompute)
    E, M = pr.activation, pr.mask
    ffn = 4 * h if ffn is None else ffn
    kv = a if kv_heads is None else kv_heads
    sp = sequence_parallel and t > 1
    seq = (s * b * h / t) if sp else s * b * h          # replicated region, split along s with SP
    if recompute == "full":
        return E * seq
    if implementation == "megatron":
        return _megatron_layer(s=s, b=b, h=h, a=a, kv=kv, ffn=ffn, t=t, sp=sp, E=E, M=M, mlp=mlp,
                               selective=recompute == "selective", dropout=dropout, moe=moe)
    T = s * b                                            # tokens of a microbatch
    Tr = T / t if sp else T                              # tokens of the replicated region on this rank
    d = h // a
    a_l = a / t
    kv_l = kv / t if kv >= t else 1                      # key/value heads held here (replicated if kv < t)
    flash = (attention == "sdpa" and not dropout) or attention == "ring"

    norm_bytes = E * seq + (2 * E * Tr if norm == "layernorm" else 4 * Tr)   # input + statistics
    total = 2 * norm_bytes                                                    # before attention and MLP
    total += (1 if moe is not None else 2) * E * T * h                        # attention and MLP inputs (gathered)
    # Query/key/value storages: what the attention (or the rotary rotation) keeps.
    if kv == a:
        total += E * T * 3 * a_l * d + (E * T * 2 * a_l * d if rope else 0)  # fused qkv; rotated q, k
    elif not flash and recompute != "selective" and kv_l < a_l:
        total += E * T * 3 * a_l * d                                        # q; k, v repeated per query head
    elif rope:
        total += E * T * 2 * kv_l * d + E * T * (a_l + kv_l) * d            # kv (for v); rotated q, k
    else:
        total += E * T * (a_l + 2 * kv_l) * d                               # q; kv
    total += E * T * a_l * d                                                  # attention output = projection input
    if recompute != "selective":                                              # the core keeps its own tensors
        if flash:
            total += 4 * T * a_l                                              # log-sum-exp per query (fp32)
            # The ring's own output [b, a/t, s, d]. The projection keeps its input, that output
            # reordered to [s, b, h/t]: a copy, except where the reordering moves only size-1
            # dimensions and the input is a view of the same storage: the split backward's linear
            # keeps it as it is (a view with one head here), torch's linear as [s b, h/t] (a view
            # with one head and one sample); one token is a view either way.
            if attention == "ring" and not (s == 1 or (a_l == 1 and (b == 1 or split_backward))):
                total += E * T * a_l * d
        else:
            scores = b * a_l * s * s
            total += s * s + 4 * scores                                       # causal mask, fp32 softmax
            if dropout:
                total += 2 * E * scores                                       # keep mask, dropped probabilities
            elif E != 4:
                total += E * scores                                           # the probabilities in bf16
    if moe is None:
        total += E * T * (ffn / t) * (4 if mlp == "swiglu" else 2)            # up (gate, up), activation, product
    else:
        total += moe_activation_bytes(moe, tokens=Tr, t=t, sp=sp, precision=pr, ep=ep, expert_tp=expert_tp,
                                      ep_rank=ep_rank)
    if dropout:
        total += 2 * E * seq                                                  # two residual dropouts' masks
    return total


def moe_activation_bytes(model: GPTConfig, *, tokens: float, t: int = 1, sp: bool = False, precision="bf16",
                         ep: int = 1, expert_tp: int = 1, ep_rank: int = 0) -> float:
    """Bytes a mixture-of-experts MLP keeps for backward per microbatch on a rank of expert-parallel
    rank ``ep_rank``, ``tokens`` being this rank's tokens, every rank routing alike
    (:func:`~mlmkit.estimate.params.moe_kept_by_expert`: exact with ``moe_force_uniform``, an even
    routing's mean otherwise, at most the capacity): what :class:`mlmkit.moe.MoELayer` saves.

    Router: its fp32 input (and, under bf16, the fp32 copy of its weight), the softmax (or sigmoid)
    scores ``[T, E]``, the chosen indices (int64), the weights and their sum when renormalised; with
    a capacity the keep mask (bool ``[T k]``); with the load-balancing loss the expert fractions
    ``[E]`` (and the per-token sum of sigmoid scores), with the z-loss the logits ``[T, E]`` and
    their log-sum-exp ``[T]``, and with either the summed routing statistics (``2 E + 2`` fp32, the
    divisor lives there). Permutation: four int64
    index vectors (two over the kept assignments, two over the received rows). Experts: their input
    rows (gathered over expert-tp), the MLP's internals (as a dense MLP of width ``moe_ffn /
    expert_tp``), the outputs and their weighted copies. The shared expert is a dense MLP over all
    tokens."""
    pr = _precision(precision)
    E, T, h, k, Ex = pr.activation, tokens, model.hidden, model.top_k, model.experts
    kept = moe_kept_by_expert(model, T)              # assignments each expert keeps from each rank
    local = Ex // ep
    A = sum(kept)                                    # assignments kept from this rank
    R = ep * sum(kept[ep_rank * local:(ep_rank + 1) * local])   # rows the experts of ep rank ep_rank receive
    et = expert_tp
    total = 4 * T * h                                # router input in fp32 (the MLP input itself in fp32)
    if E != 4:
        total += 4 * Ex * h                          # the router weight's fp32 copy (bf16 runs)
    total += 4 * T * Ex + 8 * T * k                  # scores, chosen experts
    if model.moe_renormalize:
        total += 4 * T * k + 4 * T                   # weights and their sum
    if model.moe_capacity_factor is not None:
        total += T * k                               # which assignments are kept (bool)
    if model.moe_aux_loss_coeff > 0:
        total += 4 * Ex                              # f_e, the fraction of assignments per expert
        if model.moe_router == "sigmoid":
            total += 4 * T                           # the per-token sum normalising the sigmoid scores
    if model.moe_z_loss_coeff > 0:
        total += 4 * T * Ex + 4 * T                  # logits and their log-sum-exp
    if model.moe_aux_loss_coeff > 0 or model.moe_z_loss_coeff > 0:
        total += 4 * (2 * Ex + 2)                    # the summed statistics (the token count divides)
    total += 8 * A * 2 + 8 * R * 2                   # sort orders and regrouping indices
    rows_seen = R * et                               # rows of the expert-tp group, gathered
    total += E * rows_seen * h                       # expert inputs
    total += E * rows_seen * (model.moe_ffn / et) * (4 if model.mlp == "swiglu" else 2)
    total += (4 if E == 4 else 2) * A                # each assignment's weight, in the output dtype
    total += 2 * E * A * h                           # expert outputs and their weighted copies
    if model.moe_shared_ffn_hidden:
        Tg = T * t if sp else T                      # gathered over tp with sequence parallelism
        if E != 4 or sp:
            total += E * Tg * h                      # the shared expert's input (fp32: the router's)
        total += E * Tg * (model.moe_shared_ffn_hidden / t) * (4 if model.mlp == "swiglu" else 2)
    return total


def weight_grad_bytes_per_layer(*, s: int, b: int, h: int, a: int, ffn: Optional[int] = None, t: int = 1,
                                sequence_parallel: bool = False, precision="bf16", kv_heads: Optional[int] = None,
                                mlp: str = "gelu", gate_up_fused: bool = True, moe: Optional[GPTConfig] = None,
                                expert_tp: int = 1, ep: int = 1, ep_rank: int = 0) -> float:
    """Bytes one layer keeps from its split backward's B until its W (zero-bubble schedules), per
    microbatch: every linear layer's input ``X`` and output gradient ``dY`` (W computes ``dY^T X``).
    Inputs shared by two linears (q and kv, gate and up) count once; with sequence parallelism the
    column-parallel inputs and the row-parallel output gradients are the gathered ``[s, b, h]``.
    With ``moe`` (a mixture-of-experts model) the MLP is its experts, routed evenly: their rows
    (gathered over ``expert_tp``) into fc1 and fc2 and those layers' output gradients, and the shared
    expert, if any, as a dense MLP; the router's product is no deferred linear."""
    pr = _precision(precision)
    E, T = pr.activation, s * b
    ffn = 4 * h if ffn is None else ffn
    kv = a if kv_heads is None else kv_heads
    d, a_l = h // a, a / t
    kv_l = kv / t if kv >= t else 1
    x = T * h + T * a_l * d                                            # qkv, proj inputs
    dy = T * (a_l + 2 * kv_l) * d + T * h                              # qkv (q + kv) and proj output gradients

    def mlp_held(rows: float, width: float, gated: bool) -> float:     # fc1 (gate, up), fc2: X and dY
        return rows * (h + width + (2 * width if gated else width) + h)

    if moe is None:
        x_dy = mlp_held(T, ffn / t, mlp == "swiglu")
    else:   # each expert's rows, gathered over expert-tp; the shared expert as a dense MLP
        kept = moe_kept_by_expert(moe, T / t if sequence_parallel and t > 1 else T)
        local = moe.experts // ep
        rows = ep * sum(kept[ep_rank * local:(ep_rank + 1) * local]) * expert_tp
        x_dy = mlp_held(rows, moe.moe_ffn / expert_tp, moe.mlp == "swiglu")
        if moe.moe_shared_ffn_hidden:
            x_dy += mlp_held(T, moe.moe_shared_ffn_hidden / t, moe.mlp == "swiglu")
    return E * (x + dy + x_dy)


def _megatron_layer(*, s, b, h, a, kv, ffn, t, sp, E, M, mlp, selective, dropout, moe=None) -> float:
    # Korthikanti et al. 2022, section 4.1, term by term (E = 2, M = 1 gives their 34 + 5as/h). A
    # mixture of experts (whole experts on each rank, routed evenly) replaces the MLP's fc1 input and
    # internals by its experts': each of this rank's tokens is top_k rows of fc1 input, internals of
    # width moe_ffn and output kept for the weighted combine, plus the router's fp32 probabilities
    # (Megatron-Core's all-to-all dispatcher); a shared expert is a dense MLP beside them.
    replicated = 1 / t if sp else 1.0                    # LayerNorm inputs, QKV and fc1 inputs, dropout masks
    sbh = s * b * h
    total = 2 * E * sbh * replicated                                    # two LayerNorm inputs
    total += E * sbh * replicated                                       # QKV input
    total += E * sbh / t + 2 * E * sbh * (kv / a) / t                   # Q, K (for QK^T), V
    total += E * sbh / t                                                # projection input
    total += M * sbh * replicated                                       # attention dropout mask
    if not selective:
        attn = a * s * s * b / t
        total += E * attn + (M * attn + E * attn if dropout else 0)     # softmax; dropout mask and output
    if moe is None:
        total += E * sbh * replicated                                   # fc1 input
        total += (2 if mlp == "gelu" else 4) * E * s * b * ffn / t     # activation input(s) and output(s)
    else:
        rows = moe.top_k * s * b * replicated                           # expert rows on this rank
        total += 2 * E * rows * h                                       # expert inputs and outputs
        total += (2 if mlp == "gelu" else 4) * E * rows * moe.moe_ffn   # the experts' internals
        total += 4 * s * b * replicated * moe.experts                   # router probabilities (fp32)
        if moe.moe_shared_ffn_hidden:
            total += E * sbh * replicated + (2 if mlp == "gelu" else 4) * E * s * b * moe.moe_shared_ffn_hidden / t
    total += M * sbh * replicated                                       # MLP dropout mask
    if not dropout:
        total -= 2 * M * sbh * replicated
    return total


def _stage_weight_extra(model: GPTConfig, *, s: int, b: int, t: int, post: bool, pr: Precision) -> float:
    # The output head's input and output gradient (the logits' gradient), held from B to W.
    if not post:
        return 0.0
    return pr.activation * s * b * (model.hidden + model.padded_vocab(t) / t)


def _split_backward_rise(model: GPTConfig, *, s: int, b: int, t: int, sp: bool, post: bool, layers: int,
                         pr: Precision, net_per_layer: float, mean_loss: bool = False,
                         pad_mask: float = 0.0) -> float:
    """How far a split backward's I rises above what its chunk held before it (a transient the
    action's two ends miss). Walking a layer back from its output, the first thing kept for W is
    fc2's output gradient (``[s, b, h]``, gathered with SP), freed before it only a dropout mask; the
    MLP then frees its internals for fc1's output gradient (GELU: as much as it keeps; SwiGLU: the
    product more), the second norm its input, and the attention projection's output gradient comes
    next (``[s, b, h]``); the attention core frees at least what its qkv gradient takes. Each layer
    walked adds ``net_per_layer`` (kept for W less its activations). On the loss's chunk the walk
    first frees the loss's tensors (the logits' gradient kept in their place) and the final norm.
    Mixtures of experts free their outputs before their fc2s (no rise); a shared expert, computed
    last, is walked first (its fc2's gradient only)."""
    E, T, h = pr.activation, s * b, model.hidden
    if model.moe and not model.moe_shared_ffn_hidden:
        return 0.0
    tokens = T / t if sp else T                                      # the replicated region's tokens here
    mask = E * tokens * h if model.dropout > 0 else 0.0              # a residual dropout's mask
    norm = E * tokens * h + (2 * E * tokens if model.norm == "layernorm" else 4 * tokens)
    first = E * T * h - mask                                         # fc2's output gradient kept
    if model.moe:
        peak = first
    else:
        mlp = -E * T * model.ffn / t if model.mlp == "swiglu" else 0.0   # SwiGLU frees silu(gate) too
        peak = max(first, first + mlp - norm - mask + E * T * h)     # ... then the projection's
    rise = peak + max(0.0, (layers - 1) * net_per_layer)
    if post:
        vocab = model.padded_vocab(t) / t
        rise += E * T * vocab - (4 * T * vocab + 8 * T + 2 * T + (8 if mean_loss else 0) + pad_mask) - norm  # loss, norm
    return max(rise, 0.0)


def _stage_extra(model: GPTConfig, *, s: int, b: int, t: int, sp: bool, pre: bool, post: bool, layers: int,
                 pr: Precision, cp: int = 1, recompute: str = "none", mean_loss: bool = False,
                 pad_mask: float = 0.0) -> float:
    # mlmkit's first/last-stage activations outside the layers (see module docstring); s: this
    # rank's tokens (s / cp); pad_mask: the bytes of this rank's padded-columns mask (_pad_mask).
    E, h = pr.activation, model.hidden
    extra = 0.0
    if pre:
        extra += 8 * b * s + b * s                           # embedding indices (int64), out-of-range mask
        if cp > 1 and model.position == "learned":
            extra += 8 * s                                   # the held positions, indexing the position table
        if model.dropout:
            extra += E * (s * b * h / t if sp else s * b * h)     # embedding dropout's mask
    if model.position == "rope" and layers and recompute != "full":
        # cos and sin tables (fp32), shared by the layers (full recomputation keeps only layer inputs)
        extra += 2 * 4 * s * model.head_dim
    if post:
        tokens = s * b / t if sp else s * b
        extra += E * tokens * h + (2 * E * tokens if model.norm == "layernorm" else 4 * tokens)  # final norm
        extra += E * s * b * h                                    # head input (gathered with SP)
        extra += 4 * s * b * model.padded_vocab(t) / t            # fp32 softmax over the local vocabulary
        extra += 8 * s * b + 2 * s * b                            # targets (int64), two bool masks
        if mean_loss:
            extra += 8                                            # the microbatch's target count (int64)
        extra += pad_mask                                         # the padded columns' mask (bool)
    return extra


def _pad_mask(model: GPTConfig, *, t: int, tp_rank: int) -> int:
    """Bytes of the bool mask the loss keeps for the padded vocabulary columns in tensor-parallel
    rank ``tp_rank``'s slice (``masked_fill`` saves it for backward): ``V/t`` where the slice reaches
    past ``vocab_size``, else 0 (:func:`mlmkit.tensor_parallel.vocab_parallel_cross_entropy`)."""
    local = model.padded_vocab(t) // t
    return local if (tp_rank + 1) * local > model.vocab_size else 0


def estimate_memory(model: GPTConfig, topology: Topology, *, micro_batch_size: int, microbatches: int,
                    schedule: Union[str, Schedule] = "1f1b", chunks: int = 1, sequence_parallel: bool = False,
                    recompute: Union[bool, str] = False, zero1: bool = False, precision: Optional[str] = None,
                    implementation: str = "mlmkit", layers_per_stage: Optional[Sequence[int]] = None,
                    microbatch_group: Optional[int] = None, zero: Optional[int] = None, prefetch: int = 0,
                    reshard_after_forward: bool = True, per_token_loss: bool = True):
    """Estimated bytes per rank as a DataFrame indexed by rank.

    Columns: ``parameters``, ``gradients``, ``optimizer``, ``activations`` (peak over the step),
    ``total``. For a training run, :func:`estimate_train_memory` takes every option from its
    :class:`~mlmkit.train.TrainConfig`.

    ``zero`` (``zero1=True`` is 1): 2 and 3 shard unit by unit (:mod:`mlmkit.data_parallel.zero`),
    each unit padded to a multiple of the replicas; under 3 ``parameters`` is the shards plus the
    most that is gathered at once (the chunk's root and ``1 + prefetch`` layers, or every unit
    with ``reshard_after_forward=False``); gradients are whole until a layer's last backward of the
    step has passed, then an fp32 shard (whole until the update under a split backward).
    ``per_token_loss=False`` (the mean of the microbatches' means) keeps each microbatch's target count.
    ``schedule``: a generator's name, or a :class:`~mlmkit.pipeline.Schedule` of one's own (hand-written,
    read from torch's CSV) for this pipeline: the activations held are counted from its actions.
    """
    import pandas as pd

    if precision is None:
        raise ValueError("estimate_memory: give precision='fp32' or 'bf16' (the run's; never assumed), or call "
                         "estimate_train_memory(config), which takes everything from the config")
    pr = _precision(precision)
    check_estimate(model, topology, micro_batch_size=micro_batch_size, microbatches=microbatches, chunks=chunks,
                   sequence_parallel=sequence_parallel, zero=zero, prefetch=prefetch, recompute=recompute,
                   flags=dict(zero1=zero1, reshard_after_forward=reshard_after_forward, per_token_loss=per_token_loss),
                   what="estimate_memory")
    if isinstance(schedule, Schedule):
        # a schedule of one's own (schedule_from_table, from_torch): its actions, checked to run and
        # to be this run's (a peak read from another pipeline's actions would be silently wrong)
        got = (schedule.stages, schedule.microbatches, schedule.chunks)
        if got != (topology.pp, microbatches, chunks):
            raise ValueError(f"estimate_memory: the schedule has stages={got[0]}, microbatches={got[1]}, "
                             f"chunks={got[2]}; this estimate has pp={topology.pp}, microbatches={microbatches}, "
                             f"chunks={chunks}")
        if microbatch_group is not None:
            raise ValueError("estimate_memory: microbatch_group builds a named schedule; a Schedule given as is "
                             "already has its order")
        sched = validate(schedule)
    else:
        sched = make_schedule(schedule, stages=topology.pp, microbatches=microbatches, chunks=chunks,
                              layers=model.layers, microbatch_group=microbatch_group)
    placement = sched.placement
    cp = topology.cp
    s, b, t = model.seq_len // cp, micro_batch_size, topology.tp          # s: this rank's tokens
    attention = model.attention if implementation == "mlmkit" else "eager"
    if cp > 1 and implementation == "mlmkit":
        attention = "ring"
    sp = sequence_parallel and t > 1
    idle = moe_idle_experts(model, s * b // t if sp else s * b) if model.moe and implementation == "mlmkit" else set()
    rows = []
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        ep_rank = topology.expert_coords(rank).ep
        params = local_parameters(model, topology, pp_rank=c.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                                  layers_per_stage=layers_per_stage, placement=placement, ep_rank=ep_rank)
        n = sum(p.numel for p in params)
        stage = (1 if zero1 else 0) if zero is None else zero
        param_bytes, grad_bytes = n * pr.param, n * pr.grad
        if idle and stage == 1 and pr.name == "fp32":
            # experts no token reaches get no gradient: ZeRO-1 reads a missing one as zeros without
            # storing it (plain data parallelism zero-fills it for its all-reduce; bf16 keeps fp32
            # gradient buffers for every parameter from the start)
            grad_bytes -= pr.grad * sum(p.numel for p in params if p.expert and _expert_index(p.name) in idle)
        if stage >= 2:   # unit by unit over the dp x cp replicas (dense models)
            d = topology.dp * cp
            units = shard_unit_sizes(model, topology, pp_rank=c.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                                     layers_per_stage=layers_per_stage, placement=placement)
            shard = sum(-(-u["numel"] // d) for u in units)
            if stage == 2:
                optimizer = shard * (2 * pr.state + (pr.master or pr.param))
            else:
                optimizer = shard * (2 * pr.state + pr.master)     # fp32: the master shard is the parameter shard
                if reshard_after_forward:
                    gathered = 0
                    for ch in range(chunks):
                        root = sum(u["numel"] for u in units if u["chunk"] == ch and u["kind"] == "root")
                        layers = [u["numel"] for u in units if u["chunk"] == ch and u["kind"] == "layer"]
                        gathered = max(gathered, root + sum(sorted(layers, reverse=True)[:1 + prefetch]))
                else:
                    gathered = n
                param_bytes = shard * pr.param + gathered * pr.param
            if not sched.split_backward:
                grad_bytes = _sharded_grad_peak(units, sched.compute_actions(c.pp), chunks=chunks, d=d,
                                                m=microbatches, G=pr.grad)
        elif stage == 1:   # dense parameters sharded over the dp x cp replicas, experts over their expert-dp replicas
            d = topology.dp * cp
            # a tied word embedding's copies: each a shard of its own (mlmkit.data_parallel.optimizer)
            tied = [p.numel for p in params if d > 1 and p.tied_embedding]
            experts = sum(p.numel for p in params if p.expert)
            dense = n - experts - sum(tied)
            shard = -(-dense // d) + sum(-(-x // d) for x in tied) + -(-experts // topology.expert_dp)
            optimizer = shard * (2 * pr.state + (pr.master or pr.param))
        else:
            optimizer = n * (2 * pr.state + pr.master)
        layer = activation_bytes_per_layer(
            s=s, b=b, h=model.hidden, a=model.heads, ffn=model.ffn, t=t, sequence_parallel=sp, recompute=recompute,
            dropout=model.dropout > 0, precision=pr, implementation=implementation, kv_heads=model.num_kv_heads,
            mlp=model.mlp, norm=model.norm, rope=model.position == "rope", attention=attention,
            moe=model if model.moe else None, ep=topology.ep,
            expert_tp=topology.expert_tp, ep_rank=ep_rank, split_backward=sched.split_backward)
        held_for_w = weight_grad_bytes_per_layer(
            s=s, b=b, h=model.hidden, a=model.heads, ffn=model.ffn, t=t, sequence_parallel=sp, precision=pr,
            kv_heads=model.num_kv_heads, mlp=model.mlp, gate_up_fused=model.gate_up_fused,
            moe=model if model.moe else None, expert_tp=topology.expert_tp, ep=topology.ep, ep_rank=ep_rank)
        full = _recompute(recompute) == "full" and implementation == "mlmkit"
        pad = _pad_mask(model, t=t, tp_rank=c.tp)
        per_chunk, per_chunk_w, first_input, first_dy = [], [], [], []
        for st in stage_layout(model, topology, pp_rank=c.pp, chunks=chunks, layers_per_stage=layers_per_stage,
                               placement=placement):
            extra = _stage_extra(model, s=s, b=b, t=t, sp=sp, pre=st["pre_process"], post=st["post_process"],
                                 layers=len(st["layers"]), pr=pr, cp=cp, recompute=_recompute(recompute),
                                 mean_loss=not per_token_loss, pad_mask=pad) if implementation == "mlmkit" else 0.0
            per_chunk.append(len(st["layers"]) * layer + extra)
            first_dy.append(_split_backward_rise(model, s=s, b=b, t=t, sp=sp, post=st["post_process"],
                                                 layers=len(st["layers"]), pr=pr, net_per_layer=held_for_w - layer,
                                                 mean_loss=not per_token_loss, pad_mask=pad)
                            if st["layers"] and implementation == "mlmkit" else 0.0)
            # Full recomputation: a layer's checkpointed input goes when its backward is done, the
            # chunk's first (and the embedding's indices) last, after every layer kept its tensors for W.
            first_input.append((layer if st["layers"] else 0) + _stage_extra(
                model, s=s, b=b, t=t, sp=sp, pre=st["pre_process"], post=False, layers=len(st["layers"]), pr=pr,
                cp=cp, recompute="full") if full else 0.0)
            # Split backward: from B to W a microbatch keeps every linear's input and output gradient.
            per_chunk_w.append(len(st["layers"]) * held_for_w + _stage_weight_extra(
                model, s=s, b=b, t=t, post=st["post_process"], pr=pr) if implementation == "mlmkit"
                else per_chunk[-1])
        held = peak = 0.0
        for act in sched.compute_actions(c.pp):
            if act.kind == "F":
                held += per_chunk[act.chunk]
            elif act.kind == "B":                 # full backward: everything freed
                held -= per_chunk[act.chunk]
            elif act.kind == "I":                 # split backward: inputs and output gradients kept for W
                peak = max(peak, held + first_dy[act.chunk])
                if full:                          # everything retained, the first layer's input not yet freed
                    peak = max(peak, held - per_chunk[act.chunk] + per_chunk_w[act.chunk] + first_input[act.chunk])
                held += per_chunk_w[act.chunk] - per_chunk[act.chunk]
            else:                                 # W
                held -= per_chunk_w[act.chunk]
            peak = max(peak, held)
        rows.append({"rank": rank, "parameters": param_bytes, "gradients": grad_bytes, "optimizer": optimizer,
                     "activations": peak})
    df = pd.DataFrame(rows).set_index("rank")
    df["total"] = df.sum(axis=1)
    return df


def _expert_index(name: str) -> int:
    # "layers.3.mlp.experts.5.fc1.weight" -> 5
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1])


def _sharded_grad_peak(units: list[dict], actions, *, chunks: int, d: int, m: int, G: int) -> int:
    """The most gradient bytes a ZeRO-2/3 rank holds at once (:mod:`mlmkit.data_parallel.zero`):
    gradients accumulate whole over a chunk's backward passes; in its last one each layer is
    reduced to an fp32 shard once its backward has passed (a chunk's first layer whose input is a
    received activation, at the end of the pass); roots at the optimizer step."""
    per = {c: {"root": 0, "post": 0, "layers": [], "pre": False} for c in range(chunks)}
    for u in units:
        ch = per[u["chunk"]]
        ch["pre"] = u["pre_process"]
        if u["kind"] == "root":             # the root and a tied embedding copy: reduced at the step
            ch["root"] += u["numel"]
            ch["post"] += u["post_numel"]
        else:
            ch["layers"].append(u["numel"])
    shard = {c: [-(-n // d) * 4 for n in ch["layers"]] for c, ch in per.items()}     # fp32 shard gradients
    whole = {c: (ch["root"] + sum(ch["layers"])) * G for c, ch in per.items()}
    passes = {c: 0 for c in per}
    state = {c: 0 for c in per}              # gradient bytes of each chunk at the end of the last action
    peak = 0
    for act in actions:
        if act.kind != "B":
            continue
        c = act.chunk
        passes[c] += 1
        if passes[c] < m:
            state[c] = whole[c]
            peak = max(peak, sum(state.values()))
            continue
        others = sum(v for k, v in state.items() if k != c)
        ch, L, S = per[c], per[c]["layers"], shard[c]
        root = ch["root"] if m > 1 else ch["post"]
        k = len(L)
        for i in range(k - 1, -1, -1):        # the moment before layer i is reduced
            before = sum(L[:i]) if m > 1 else 0
            if i == 0 and not ch["pre"]:       # reduced at the end of the pass: everything else has run
                root, before = ch["root"], 0
            peak = max(peak, others + (root + before + L[i]) * G + sum(S[i + 1:]))
        state[c] = ch["root"] * G + sum(S)
        peak = max(peak, sum(state.values()))
    return peak


def estimate_train_memory(config, *, implementation: str = "mlmkit"):
    """:func:`estimate_memory` for a :class:`~mlmkit.train.TrainConfig`: its model, layout, schedule,
    microbatching, sequence parallelism, recomputation, ZeRO stage and precision, never another."""
    return estimate_memory(config.model, config.topology, micro_batch_size=config.micro_batch_size,
                           microbatches=config.microbatches, chunks=config.chunks,
                           schedule=config.pipeline_schedule() if config.schedule_file else config.schedule,
                           sequence_parallel=config.sequence_parallel, recompute=config.recompute,
                           zero=config.zero, precision=config.precision, implementation=implementation,
                           microbatch_group=config.microbatch_group, prefetch=config.prefetch,
                           reshard_after_forward=config.reshard_after_forward, per_token_loss=config.per_token_loss)
