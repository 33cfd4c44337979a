"""Routing math of a mixture-of-experts layer (torch, no communication).

A router scores every token against every expert, each token goes to its ``top_k`` experts, and
its output is the weighted sum of theirs (Shazeer et al. 2017; GShard, Lepikhin et al. 2020;
Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024; DeepSeek-V3 2024 for sigmoid scores).

- :func:`route`: logits ``[T, E]`` -> expert indices and weights ``[T, k]``, and the per-expert
  scores the load-balancing loss uses;
- :func:`capacity_keep`: with a capacity, which of a rank's assignments each expert keeps;
- :func:`uniform_indices`: the forced even routing of ``GPTConfig.moe_force_uniform``;
- :func:`balance_terms`: the local parts of the Switch/GShard load-balancing loss and the z-loss.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

__all__ = ["Routing", "balance_terms", "capacity", "capacity_keep", "route", "uniform_indices"]


class Routing(NamedTuple):
    """``indices [T, k]`` (int64), ``weights [T, k]`` (fp32, differentiable), ``scores [T, E]``
    (fp32, differentiable: softmax probabilities, or sigmoid scores normalised per token)."""

    indices: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor


def uniform_indices(tokens: int, top_k: int, experts: int, *, offset: int = 0, device=None) -> torch.Tensor:
    """Token ``t``'s ``j``-th choice is expert ``((offset + t) * top_k + j) mod experts``: every expert
    gets the same number of assignments when ``tokens * top_k`` divides by ``experts``."""
    t = torch.arange(tokens, device=device)[:, None] + offset
    return (t * top_k + torch.arange(top_k, device=device)[None, :]) % experts


def route(logits: torch.Tensor, *, top_k: int, score: str = "softmax", renormalize: bool = True,
          force_uniform: bool = False, offset: int = 0, scores_grad: bool = True) -> Routing:
    """Choose ``top_k`` experts per token from router ``logits [T, E]`` (computed in fp32).

    softmax: ``p = softmax(logits)``, the ``k`` largest ``p``; sigmoid: ``s = sigmoid(logits)``, the
    ``k`` largest ``s``. Weights are those scores, divided by their sum when ``renormalize``.
    ``force_uniform`` replaces the choice by :func:`uniform_indices` (weights still the router's).
    ``scores_grad=False``: the sigmoid's normalised scores get no graph (no load-balancing loss
    needs them; their division would otherwise save its ``[T, 1]`` divisor for nothing)."""
    logits = logits.float()
    if score == "softmax":
        s = logits.softmax(dim=-1)
        scores = s
    elif score == "sigmoid":
        s = torch.sigmoid(logits)
        with contextlib.nullcontext() if scores_grad else torch.no_grad():
            scores = s / s.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"route: score={score!r}: expected 'softmax' or 'sigmoid'")
    if force_uniform:
        idx = uniform_indices(logits.shape[0], top_k, logits.shape[1], offset=offset, device=logits.device)
        w = s.gather(1, idx)
    else:
        w, idx = s.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return Routing(indices=idx, weights=w, scores=scores)


def capacity(tokens: int, *, top_k: int, experts: int, factor: float) -> int:
    """Assignments one expert accepts from ``tokens`` tokens: ``ceil(factor * tokens * top_k / experts)``."""
    return math.ceil(factor * tokens * top_k / experts)


def capacity_keep(indices: torch.Tensor, weights: torch.Tensor, *, experts: int, cap: int,
                  policy: str = "probs") -> torch.Tensor:
    """``[T, k]`` bool: which assignments survive when each expert keeps at most ``cap`` of them.

    ``policy="probs"``: an expert keeps its ``cap`` assignments with the largest weights (ties: the
    earlier token, then the earlier choice); ``"position"``: the first ``cap`` in token order."""
    T, k = indices.shape
    flat_e = indices.reshape(-1)
    order = torch.arange(T * k, device=indices.device)                  # token-major position
    if policy == "probs":
        # stable sorts, least significant key first: position, then weight (descending), then expert
        by_w = torch.sort(-weights.detach().reshape(-1)[order], stable=True).indices
        order = order[by_w]
    elif policy != "position":
        raise ValueError(f"capacity_keep: policy={policy!r}: expected 'probs' or 'position'")
    order = order[torch.sort(flat_e[order], stable=True).indices]       # grouped by expert
    e_sorted = flat_e[order]
    counts = torch.bincount(e_sorted, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(T * k, device=indices.device) - starts[e_sorted]
    keep = torch.zeros(T * k, dtype=torch.bool, device=indices.device)
    keep[order] = rank_in_expert < cap
    return keep.view(T, k)


def balance_terms(logits: torch.Tensor, routing: Routing, *, experts: int):
    """This rank's local sums for the load-balancing and z losses: ``(counts [E] (no grad), score
    sums [E] (grad), sum of squared log-sum-exp (grad))``. The losses of a microbatch are
    ``aux = E * sum_e (counts_e / (T k)) (score_sum_e / T)`` and ``z = sum lse^2 / T`` with every sum
    taken over the microbatch's ``T`` tokens (all ranks that split them)."""
    counts = torch.bincount(routing.indices.reshape(-1), minlength=experts).float()
    score_sums = routing.scores.sum(dim=0)
    z = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
    return counts, score_sums, z
