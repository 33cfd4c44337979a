"""The same Transformer in plain PyTorch: one device, ``nn.Linear``, ``nn.LayerNorm``/``nn.RMSNorm``,
``scaled_dot_product_attention``, no mlmkit layer and no communication operator.

What mlmkit's :class:`~mlmkit.model.GPT` computes, written the way a tutorial would, so a reader
can check the parallel model against code that has nothing to do with it (tests do, with weights
copied by :meth:`PlainTransformer.load_mlmkit`), and benchmarks can time mlmkit against it.
Shapes: batch first, ``[b, s, h]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlmkit.model.config import GPTConfig

__all__ = ["PlainTransformer"]


class _Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        norm = (lambda: nn.RMSNorm(c.hidden, eps=c.layernorm_eps)) if c.norm == "rmsnorm" else \
            (lambda: nn.LayerNorm(c.hidden, eps=c.layernorm_eps, bias=c.bias))
        d, kv = c.head_dim, c.num_kv_heads
        self.c = c
        self.norm1, self.norm2 = norm(), norm()
        self.q = nn.Linear(c.hidden, c.heads * d, bias=c.bias)
        self.k = nn.Linear(c.hidden, kv * d, bias=c.bias)
        self.v = nn.Linear(c.hidden, kv * d, bias=c.bias)
        self.o = nn.Linear(c.hidden, c.hidden, bias=c.bias)
        if c.mlp == "swiglu":
            self.gate = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.up = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.down = nn.Linear(c.ffn, c.hidden, bias=c.bias)

    def forward(self, x, cos, sin):
        c, (b, s, _) = self.c, x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, c.heads, c.head_dim).transpose(1, 2)            # [b, a, s, d]
        k = self.k(y).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)     # [b, kv, s, d]
        v = self.v(y).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.grouped)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, c.hidden))
        y = self.norm2(x)
        hidden = F.silu(self.gate(y)) * self.up(y) if c.mlp == "swiglu" else F.gelu(self.up(y))
        return x + self.down(hidden)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return (x.float() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).float() * sin).to(x.dtype)


class PlainTransformer(nn.Module):
    """``config``'s model on one device (dropout is not supported: the reference is deterministic)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.dropout:
            raise ValueError("PlainTransformer: dropout is not supported (use dropout=0)")
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        if c.position == "learned":
            self.pos = nn.Parameter(torch.zeros(c.seq_len, c.hidden))
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=c.layernorm_eps) if c.norm == "rmsnorm" else \
            nn.LayerNorm(c.hidden, eps=c.layernorm_eps, bias=c.bias)
        self.head = None if c.tie_embeddings else nn.Linear(c.hidden, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over the non-ignored targets (-100)."""
        c, s = self.config, tokens.shape[1]
        x = self.embed(tokens)                                                   # [b, s, h]
        cos = sin = None
        if c.position == "learned":
            x = x + self.pos[:s]
        else:
            inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
            angles = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
            angles = torch.cat([angles, angles], -1)
            cos, sin = angles.cos().float(), angles.sin().float()
        for block in self.blocks:
            x = block(x, cos, sin)
        weight = self.embed.weight if self.head is None else self.head.weight
        logits = self.norm(x) @ weight.t()                                       # [b, s, V]
        return F.cross_entropy(logits.float().reshape(-1, c.vocab_size), targets.reshape(-1))

    @torch.no_grad()
    def load_mlmkit(self, state: dict) -> "PlainTransformer":
        """Copy the weights of a serial mlmkit model's ``state_dict`` (or ``export_state_dict``)."""
        c, d, kv = self.config, self.config.head_dim, self.config.num_kv_heads
        self.embed.weight.copy_(state["embedding.weight"][: c.vocab_size])
        if c.position == "learned":
            self.pos.copy_(state["position"])
        if self.head is not None:
            self.head.weight.copy_(state["head_weight"][: c.vocab_size])
        _copy_norm(self.norm, state, "final_ln")
        for i, blk in enumerate(self.blocks):
            p = f"layers.{i}"
            _copy_norm(blk.norm1, state, f"{p}.ln1")
            _copy_norm(blk.norm2, state, f"{p}.ln2")
            if c.grouped:
                q_w, kv_w = state[f"{p}.attn.q.weight"], state[f"{p}.attn.kv.weight"].view(kv, 2, d, c.hidden)
                k_w, v_w = kv_w[:, 0].reshape(kv * d, -1), kv_w[:, 1].reshape(kv * d, -1)
                biases = None
                if c.bias:
                    kv_b = state[f"{p}.attn.kv.bias"].view(kv, 2, d)
                    biases = (state[f"{p}.attn.q.bias"], kv_b[:, 0].reshape(-1), kv_b[:, 1].reshape(-1))
            else:       # fused per head: [a, 3, d]
                qkv = state[f"{p}.attn.qkv.weight"].view(c.heads, 3, d, c.hidden)
                q_w, k_w, v_w = (qkv[:, j].reshape(c.heads * d, -1) for j in range(3))
                biases = None
                if c.bias:
                    b = state[f"{p}.attn.qkv.bias"].view(c.heads, 3, d)
                    biases = tuple(b[:, j].reshape(-1) for j in range(3))
            for lin, w, j in ((blk.q, q_w, 0), (blk.k, k_w, 1), (blk.v, v_w, 2)):
                lin.weight.copy_(w)
                if biases is not None:
                    lin.bias.copy_(biases[j])
            _copy_linear(blk.o, state, f"{p}.attn.proj")
            if c.mlp == "gelu":
                _copy_linear(blk.up, state, f"{p}.mlp.fc1")
            elif c.gate_up_fused:
                w = state[f"{p}.mlp.fc1.weight"]
                blk.gate.weight.copy_(w[: c.ffn])
                blk.up.weight.copy_(w[c.ffn:])
                if c.bias:
                    b = state[f"{p}.mlp.fc1.bias"]
                    blk.gate.bias.copy_(b[: c.ffn])
                    blk.up.bias.copy_(b[c.ffn:])
            else:
                _copy_linear(blk.gate, state, f"{p}.mlp.gate")
                _copy_linear(blk.up, state, f"{p}.mlp.up")
            _copy_linear(blk.down, state, f"{p}.mlp.fc2")
        return self


def _copy_linear(lin: nn.Linear, state: dict, name: str) -> None:
    lin.weight.copy_(state[f"{name}.weight"])
    if lin.bias is not None:
        lin.bias.copy_(state[f"{name}.bias"])


def _copy_norm(norm: nn.Module, state: dict, name: str) -> None:
    norm.weight.copy_(state[f"{name}.weight"])
    if getattr(norm, "bias", None) is not None:
        norm.bias.copy_(state[f"{name}.bias"])

