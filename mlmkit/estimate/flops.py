"""FLOPs per token of a model (pure Python): what a training step costs in arithmetic.

Forward, per token (a multiply-add counts 2):

- linear layers: ``2 x`` the weights a token meets: query/key/value (``h (a + 2 kv) d``), output
  projection (``h^2``), the MLP (``2 h ffn``, SwiGLU ``3 h ffn``) or, with a mixture of experts,
  the router (``h E``), its ``top_k`` experts and the shared expert; the output head (``h V``,
  ``V`` the vocabulary padded as the model pads it for ``tp`` ranks, as Megatron-LM counts it:
  the head computes every padded column);
- attention: ``QK^T`` and ``softmax x V``, ``2 x 2 s h`` per layer, counted over the full
  sequence as Megatron-LM's formula does (causal masking would halve it; Narayanan et al. 2021).

Backward costs twice the forward; full recomputation adds one forward, selective recomputation the
attention term (Korthikanti et al. 2022). Model FLOPs (for MFU) exclude recomputation; hardware
FLOPs include it.
"""

from __future__ import annotations

from mlmkit.model.config import GPTConfig

__all__ = ["forward_flops_per_token", "training_flops_per_token"]


def _mlp_weights(model: GPTConfig, ffn: int) -> int:
    return (3 if model.mlp == "swiglu" else 2) * model.hidden * ffn


def forward_flops_per_token(model: GPTConfig, *, seq_len: int | None = None, tp: int = 1) -> dict:
    """Forward FLOPs per token: ``{"linear", "attention", "head", "total"}`` (whole model; ``tp``
    only decides the padded vocabulary of the head, :meth:`GPTConfig.padded_vocab`)."""
    s = seq_len or model.seq_len
    h, d = model.hidden, model.head_dim
    attn_w = h * (model.heads + 2 * model.num_kv_heads) * d + h * h
    if model.moe:
        mlp_w = h * model.experts + model.top_k * _mlp_weights(model, model.moe_ffn)
        if model.moe_shared_ffn_hidden:
            mlp_w += _mlp_weights(model, model.moe_shared_ffn_hidden)
    else:
        mlp_w = _mlp_weights(model, model.ffn)
    linear = 2 * model.layers * (attn_w + mlp_w)
    attention = model.layers * 4 * s * h
    head = 2 * h * model.padded_vocab(tp)       # padded columns are computed too (then masked)
    return {"linear": linear, "attention": attention, "head": head, "total": linear + attention + head}


def training_flops_per_token(model: GPTConfig, *, recompute: str = "none", seq_len: int | None = None,
                             tp: int = 1) -> dict:
    """``{"model": 3 x forward, "hardware": model + what recomputation reruns}`` per token."""
    f = forward_flops_per_token(model, seq_len=seq_len, tp=tp)
    model_flops = 3 * f["total"]
    extra = {"none": 0, "selective": f["attention"], "full": f["linear"] + f["attention"]}[recompute]
    return {"model": model_flops, "hardware": model_flops + extra}
