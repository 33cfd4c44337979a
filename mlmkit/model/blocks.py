"""The building blocks of a Transformer layer, chosen by :class:`~mlmkit.model.config.GPTConfig`.

- normalisation: :class:`LayerNorm` (GPT-2) or :class:`RMSNorm` (Zhang & Sennrich 2019; Llama);
- positions: learned embeddings (in :class:`~mlmkit.model.gpt.GPT`) or rotary embeddings
  (:func:`apply_rotary`; Su et al. 2021, RoFormer), applied to queries and keys;
- attention: :class:`ParallelAttention`, multi-head or grouped-query (Ainslie et al. 2023), heads
  split over tensor-parallel ranks, the core through ``scaled_dot_product_attention`` or the
  explicit softmax, or ring attention over a context-parallel group;
- MLP: :class:`ParallelMLP`, GELU (GPT-2) or SwiGLU (Shazeer 2020; Llama), or a mixture of
  experts (:class:`mlmkit.moe.MoELayer`) when ``config.experts > 0``;
- :class:`TransformerLayer`: pre-norm residual block, with full or selective activation
  recomputation (Korthikanti et al. 2022).

Every weight is drawn at full size from a generator seeded by (seed, parameter name) and then
sliced for this rank (:func:`mlmkit.tensor_parallel.shard_full`), so the model's function does not
depend on the layout. Shapes: hidden states ``[s, b, h]`` (``[s/t, b, h]`` in sequence-parallel
regions); per-head tensors ``[b, heads, s, d]``.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from mlmkit.distributed import CommGroup
from mlmkit.model.config import GPTConfig
from mlmkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, divide, mark_parameter
from mlmkit.tensor_parallel.random import TPRandomState, dropout

__all__ = [
    "RECOMPUTE", "LayerNorm", "ParallelAttention", "ParallelMLP", "RMSNorm", "TransformerLayer", "apply_rotary",
    "make_norm", "rotary_cos_sin", "seeded_normal",
]

#: Activation recomputation granularities (Korthikanti et al. 2022).
RECOMPUTE = ("none", "selective", "full")


def seeded_normal(seed: int, name: str, std: float):
    """An initialiser: ``shape -> N(0, std^2)`` drawn from a generator seeded by (seed, name)."""

    def init(shape: Sequence[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        return torch.randn(*shape, generator=g) * std

    return init


# ------------------------------------------------------------------------------------- normalisation
class LayerNorm(nn.LayerNorm):
    """LayerNorm whose (replicated) parameters carry mlmkit's sharding metadata."""

    def __init__(self, hidden: int, *, eps: float, sequence_parallel: bool, bias: bool = True, device=None):
        super().__init__(hidden, eps=eps, bias=bias, device=device)
        for p in self.parameters():
            mark_parameter(p, split_dim=None, global_shape=(hidden,), sequence_parallel=sequence_parallel)


class _RMSNorm(torch.autograd.Function):
    """``y = x * r * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` per token, computed in fp32.

    Saves the input in its own dtype and ``r`` in fp32 (as TransformerEngine does; PyTorch's
    composite op would keep two fp32 copies of a bf16 input). backward, with ``x^ = x r`` and
    ``g' = g w``: ``dw = sum_tokens(g x^)``, ``dx = r (g' - x^ mean(g' x^))``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _at_least_fp32(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)             # [..., 1] fp32
        ctx.save_for_backward(x, weight, r)
        return (xf * r * _at_least_fp32(weight)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        xhat = _at_least_fp32(x) * r
        g = _at_least_fp32(grad)
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        gw = g * _at_least_fp32(weight)
        dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw.to(weight.dtype), None


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.element_size() < 4 else t


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (no mean subtraction, no bias;
    Zhang & Sennrich 2019). Computed in fp32 whatever the input dtype (:class:`_RMSNorm`)."""

    def __init__(self, hidden: int, *, eps: float, sequence_parallel: bool, device=None):
        super().__init__()
        self.eps = eps
        self.weight = mark_parameter(nn.Parameter(torch.ones(hidden, device=device)), split_dim=None,
                                     global_shape=(hidden,), sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config: GPTConfig, *, sequence_parallel: bool, device=None) -> nn.Module:
    """The normalisation layer ``config.norm`` selects."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden, eps=config.layernorm_eps, sequence_parallel=sequence_parallel, device=device)
    return LayerNorm(config.hidden, eps=config.layernorm_eps, sequence_parallel=sequence_parallel,
                     bias=config.bias, device=device)


# ------------------------------------------------------------------------------------- rotary positions
def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[s, d]`` (fp32) of the rotation angles ``position * theta^(-2i/d)``, each
    frequency repeated for both halves (the "rotate half" layout of GPT-NeoX and Megatron-LM)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv[None, :]            # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)                            # [s, d]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, d]`` by the angles of its positions: ``x cos + rotate_half(x) sin``
    (in fp32 at least). backward: the transposed rotation (autograd of the same elementwise
    expression; only cos and sin are kept)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (_at_least_fp32(x) * cos + _at_least_fp32(rotated) * sin).to(x.dtype)


# ------------------------------------------------------------------------------------- recomputation
class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for backward, as recomputation does. It makes the tensors a
    recomputed region keeps visible to saved-tensor hooks (memory accounting), at no numerical cost."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def recomputed(fn: Callable, rng: TPRandomState, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` whose activations are dropped and recomputed in backward (Chen et al. 2016).

    Only the inputs are kept. The dropout streams are rewound for the rerun so it draws the same
    masks. No early stop: the rerun repeats the whole region, its collectives included, so
    communication stays predictable (:mod:`mlmkit.estimate` counts them)."""
    state = rng.get_state()
    calls = []

    def run(*args):
        if calls:  # recomputation during backward
            now = rng.get_state()
            rng.set_state(state)
            rng.recomputing = True        # layers that record statistics skip the rerun
            try:
                return fn(*args)
            finally:
                rng.set_state(now)
                rng.recomputing = False
        calls.append(1)
        return fn(*args)

    with set_checkpoint_early_stop(False):
        return checkpoint(run, *(_KeepInput.apply(x) for x in inputs), use_reentrant=False)


# ------------------------------------------------------------------------------------- attention
class ParallelAttention(nn.Module):
    """Causal self-attention with heads split across TP ranks (Shoeybi et al. 2019, figure 3b).

    forward: ``[s, b, h]`` (``[s/t, b, h]`` with SP) -> query/key/value projections, column-parallel
    -> each rank attends with its ``a/t`` query heads -> output projection, row-parallel ->
    ``[s, b, h]`` (``[s/t, b, h]``). One f/g pair: an all-reduce of the input gradient in backward
    and one of the output in forward.

    Full multi-head attention keeps one fused ``qkv`` weight laid out per head ``[a, 3, d]``, so a
    contiguous split gives each rank whole heads. Grouped-query attention (``kv_heads < heads``)
    has ``q`` ``[a d, h]`` and ``kv`` ``[kv_heads, 2, d] x h``: query heads split over tp; key/value
    heads split too when ``tp <= kv_heads``, else each is replicated on ``tp / kv_heads`` ranks (the
    ones whose query heads use it) and its weight gradient summed over them, as Megatron-LM does.
    """

    def __init__(self, config: GPTConfig, *, layer: int, tp: CommGroup, sequence_parallel: bool,
                 rng: TPRandomState, recompute: str = "none", device=None, wgrad=None,
                 cp: Optional[CommGroup] = None, cp_split: str = "balanced"):
        super().__init__()
        h, d, name = config.hidden, config.head_dim, f"layers.{layer}.attn"
        self.config, self.rng, self.sp, self.recompute = config, rng, sequence_parallel, recompute
        self.cp, self.cp_split, self.site = cp, cp_split, name
        self._rings: dict[int, object] = {}
        self.heads_local = divide(config.heads, tp.size, what="heads")
        self.replicas = config.kv_replicas(tp.size)
        self.kv_local = config.num_kv_heads // (tp.size // self.replicas)
        self.head_dim, self.dropout_p, self.grouped = d, config.dropout, config.grouped
        out_std = config.init_std / math.sqrt(2 * config.layers)
        kw = dict(tp=tp, sequence_parallel=sequence_parallel, bias=config.bias, device=device, wgrad=wgrad)
        if self.grouped:
            self.q = ColumnParallelLinear(h, config.heads * d, site=f"{name}.q", **kw,
                                          init=seeded_normal(config.seed, f"{name}.q.weight", config.init_std))
            self.kv = ColumnParallelLinear(h, 2 * config.num_kv_heads * d, site=f"{name}.kv", replicas=self.replicas,
                                           init=seeded_normal(config.seed, f"{name}.kv.weight", config.init_std), **kw)
        else:
            self.qkv = ColumnParallelLinear(h, 3 * h, site=f"{name}.qkv", **kw,
                                            init=seeded_normal(config.seed, f"{name}.qkv.weight", config.init_std))
        self.proj = RowParallelLinear(h, h, tp=tp, sequence_parallel=sequence_parallel, site=f"{name}.proj",
                                      bias=config.bias, device=device, wgrad=wgrad,
                                      init=seeded_normal(config.seed, f"{name}.proj.weight", out_std))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        if self.grouped:
            x = self.q.enter(x)                       # one f (or SP all-gather) for q and kv, as fused QKV has
            q = self.q(x, entered=True)                                          # [s, b, a d / t]
            s, b, _ = q.shape
            q = q.view(s, b, self.heads_local, d).permute(1, 2, 0, 3)            # [b, a/t, s, d]
            kv = self.kv(x, entered=True).view(s, b, self.kv_local, 2, d)        # [s, b, kv/t, 2, d]
            k, v = (kv[:, :, :, i].permute(1, 2, 0, 3) for i in range(2))        # [b, kv/t, s, d]
            return q, k, v
        qkv = self.qkv(x)                                                        # [s, b, 3h/t]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.heads_local, 3, d)                             # [s, b, a/t, 3, d]
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))        # each [b, a/t, s, d]
        return q, k, v

    def _ring(self, seq_len: int):
        if seq_len not in self._rings:
            from mlmkit.context_parallel.ring import Ring

            self._rings[seq_len] = Ring(self.cp, seq_len=seq_len, split=self.cp_split, site=f"{self.site}.ring")
        return self._rings[seq_len]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d), causal) V: ``[b, a/t, s, d]`` (keys and values may have fewer heads).
        With context parallelism ``s`` is this rank's ``s/cp`` tokens and the keys and values of the
        others come round the ring (:func:`~mlmkit.context_parallel.ring.ring_attention`)."""
        if self.cp is not None and self.cp.size > 1:
            from mlmkit.context_parallel.ring import ring_attention

            return ring_attention(q, k, v, self._ring(q.shape[2] * self.cp.size))
        drop = self.dropout_p if self.training else 0.0
        if self.config.attention == "sdpa" and drop == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:                                             # share each kv head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)              # [b, a/t, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.float().masked_fill(causal, float("-inf")).softmax(dim=-1).to(q.dtype)
        # Heads are split: each TP rank drops different entries (tensor-parallel stream).
        probs = dropout(probs, self.dropout_p, generator=self.rng.tensor_parallel, training=self.training)
        return probs @ v

    def forward(self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        q, k, v = self._project(x)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute == "selective" and self.training and torch.is_grad_enabled():
            ctx = recomputed(self._core, self.rng, q, k, v)   # keep q, k, v; recompute the core
        else:
            ctx = self._core(q, k, v)                                            # [b, a/t, s, d]
        s, b = ctx.shape[2], ctx.shape[0]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)                          # [s, b, h/t]
        out = self.proj(ctx)                                                     # [s, b, h] or [s/t, b, h]
        gen = self.rng.tensor_parallel if self.sp else self.rng.replicated
        return dropout(out, self.dropout_p, generator=gen, training=self.training)


# ------------------------------------------------------------------------------------- MLP
class ParallelMLP(nn.Module):
    """Column-parallel up projection, an elementwise activation, row-parallel down projection
    (Shoeybi et al. 2019, figure 3a): ``[s, b, h] -> [s, b, ffn/t] -> [s, b, h]``, one f/g pair.

    GELU: ``fc2(gelu(fc1 x))``. SwiGLU: ``fc2(silu(gate x) * up x)``; with ``gate_up_fused`` the
    gate and up projections are one column-parallel ``fc1`` whose two halves are split separately,
    so each rank holds the matching ``ffn/t`` rows of both and needs no communication."""

    def __init__(self, config: GPTConfig, *, layer: int, tp: CommGroup, sequence_parallel: bool,
                 rng: TPRandomState, device=None, wgrad=None, ffn: Optional[int] = None, name: Optional[str] = None,
                 dropout: bool = True):
        super().__init__()
        h, name = config.hidden, name or f"layers.{layer}.mlp"
        ffn = ffn or config.ffn
        self.dropout_p = config.dropout if dropout else 0.0
        self.rng, self.sp, self.kind = rng, sequence_parallel, config.mlp
        self.fused = config.gate_up_fused
        out_std = config.init_std / math.sqrt(2 * config.layers)
        kw = dict(tp=tp, sequence_parallel=sequence_parallel, bias=config.bias, device=device, wgrad=wgrad)
        init = lambda part: seeded_normal(config.seed, f"{name}.{part}.weight", config.init_std)  # noqa: E731
        if config.mlp == "gelu":
            self.fc1 = ColumnParallelLinear(h, ffn, site=f"{name}.fc1", init=init("fc1"), **kw)
        elif self.fused:   # [gate; up], each half split over tp
            gate, up = init("gate"), init("up")
            self.fc1 = ColumnParallelLinear(h, 2 * ffn, site=f"{name}.fc1", partitions=2,
                                            init=lambda shape: torch.cat([gate((shape[0] // 2, shape[1])),
                                                                          up((shape[0] // 2, shape[1]))]), **kw)
        else:
            self.gate = ColumnParallelLinear(h, ffn, site=f"{name}.gate", init=init("gate"), **kw)
            self.up = ColumnParallelLinear(h, ffn, site=f"{name}.up", init=init("up"), **kw)
        self.fc2 = RowParallelLinear(ffn, h, tp=tp, sequence_parallel=sequence_parallel, site=f"{name}.fc2",
                                     bias=config.bias, device=device, wgrad=wgrad,
                                     init=seeded_normal(config.seed, f"{name}.fc2.weight", out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            y = F.gelu(self.fc1(x))                                              # [s, b, ffn/t]
        elif self.fused:
            gate, up = self.fc1(x).chunk(2, dim=-1)                              # each [s, b, ffn/t]
            y = F.silu(gate) * up
        else:
            x = self.gate.enter(x)                    # one f for gate and up
            y = F.silu(self.gate(x, entered=True)) * self.up(x, entered=True)
        y = self.fc2(y)
        gen = self.rng.tensor_parallel if self.sp else self.rng.replicated
        return dropout(y, self.dropout_p, generator=gen, training=self.training)


# ------------------------------------------------------------------------------------- the layer
class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``. Shape kept: ``[s, b, h]``.

    ``recompute``: ``"full"`` keeps only the layer's input and reruns the layer in backward;
    ``"selective"`` keeps everything but the attention core (QK^T, softmax, dropout, attention over
    V), which is rerun (Korthikanti et al. 2022, section 5)."""

    def __init__(self, config: GPTConfig, *, layer: int, tp: CommGroup, sequence_parallel: bool,
                 rng: TPRandomState, recompute: str = "none", device=None, wgrad=None,
                 cp: Optional[CommGroup] = None, cp_split: str = "balanced", experts=None):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
        self.rng, self.recompute = rng, recompute
        self.ln1 = make_norm(config, sequence_parallel=sequence_parallel, device=device)
        self.attn = ParallelAttention(config, layer=layer, tp=tp, sequence_parallel=sequence_parallel,
                                      rng=rng, recompute=recompute, device=device, wgrad=wgrad, cp=cp,
                                      cp_split=cp_split)
        self.ln2 = make_norm(config, sequence_parallel=sequence_parallel, device=device)
        if config.moe:
            from mlmkit.moe.layer import MoELayer

            self.mlp = MoELayer(config, layer=layer, tp=tp, sequence_parallel=sequence_parallel, groups=experts,
                                rng=rng, device=device, wgrad=wgrad)
        else:
            self.mlp = ParallelMLP(config, layer=layer, tp=tp, sequence_parallel=sequence_parallel, rng=rng,
                                   device=device, wgrad=wgrad)

    def _forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rotary)
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return recomputed(lambda inp: self._forward(inp, rotary), self.rng, x)
        return self._forward(x, rotary)
