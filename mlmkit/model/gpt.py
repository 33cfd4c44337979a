"""A GPT built only from mlmkit's tensor-parallel layers; at tp=1 and one stage it is the serial model.

One :class:`GPT` module holds one pipeline *stage* (a contiguous run of layers, plus the embeddings
on the first stage and final LayerNorm, output head and loss on the last). ``GPT(config)`` is the
whole serial model. Parameter names use global layer indices (``layers.5.mlp.fc1.weight``) so the
same name means the same weights in every layout.

Initialisation does not depend on the layout: each full-size weight is drawn from a generator
seeded by ``(config.seed, parameter name)`` and then sliced for this TP rank, so a tp=4, pp=2 model
starts as exactly the same function as the serial one.

Shapes (Megatron-LM's layout, sequence first): tokens ``[b, s]``; hidden states ``[s, b, h]``, or
``[s/t, b, h]`` in sequence-parallel regions; local logits ``[s, b, V/t]``. With context
parallelism (``cp``) each rank holds ``s/cp`` of the tokens (which ones:
:mod:`mlmkit.context_parallel.split`), so every ``s`` above reads ``s/cp``, and attention runs as
ring attention over the cp group.

References: Radford et al. 2019 (GPT-2 architecture); Shoeybi et al. 2019 (tensor parallelism);
Korthikanti et al. 2022 (sequence parallelism); Narayanan et al. 2021 (pipeline stages);
Liu et al. 2023 (ring attention, context parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from mlmkit.distributed import CommGroup
from mlmkit.model.blocks import (
    RECOMPUTE,
    ParallelAttention,
    ParallelMLP,
    TransformerLayer,
    make_norm,
    rotary_cos_sin,
    seeded_normal,
)
from mlmkit.model.config import GPTConfig, split_layers
from mlmkit.tensor_parallel.comm import copy_to_tp, gather_from_sequence, gather_from_tp
from mlmkit.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mlmkit.tensor_parallel.layers import VocabParallelEmbedding, mark_parameter
from mlmkit.tensor_parallel.random import TPRandomState, dropout
from mlmkit.tensor_parallel.weight_grad import WeightGradStore, linear

__all__ = ["GPT", "ParallelAttention", "ParallelMLP", "Stage", "TransformerLayer", "recompute_mode",
           "seeded_normal", "split_layers"]


def recompute_mode(recompute: Union[bool, str]) -> str:
    """``"none"``, ``"selective"`` or ``"full"`` (``True``/``False`` mean full/none, the old flag)."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)} (or a bool: full/none)")
    return recompute


def _single_group() -> CommGroup:
    return CommGroup.single("tp")


# --------------------------------------------------------------------------------------- stages
@dataclass(frozen=True, kw_only=True)
class Stage:
    """The part of the model one module holds.

    Attributes:
        layers: global indices of the Transformer layers, contiguous and increasing.
        pre_process: holds the embeddings (first stage).
        post_process: holds final LayerNorm, output head and loss (last stage).
        index: position of this stage in the whole pipeline (virtual stage with interleaving); seeds
            the dropout streams (Megatron-LM's ``seed + 100 * pp_rank`` for a rank's first chunk).
        pp_rank: the pipeline rank that holds it.
    """

    layers: tuple[int, ...]
    pre_process: bool = True
    post_process: bool = True
    index: int = 0
    pp_rank: int = 0

    @classmethod
    def whole(cls, config: GPTConfig) -> "Stage":
        return cls(layers=tuple(range(config.layers)))


# ------------------------------------------------------------------------------------------ the model
class GPT(nn.Module):
    """One pipeline stage of a tensor-parallel GPT (the whole serial model by default).

    Args:
        config: model sizes and blocks.
        tp: the tensor-parallel group (``None``: serial, tp=1).
        stage: which layers and ends this module holds (``None``: the whole model).
        sequence_parallel: split LayerNorm and dropout regions along the sequence.
        recompute: ``"none"``, ``"selective"`` (the attention core) or ``"full"`` (each layer) is
            recomputed in backward instead of keeping its activations (``True``: full).
        device: where parameters live.
        dtype: parameter and compute dtype (e.g. ``torch.bfloat16``; weights are initialised in
            fp32 and cast).
        split_backward: give the linear layers a :class:`~mlmkit.tensor_parallel.WeightGradStore`
            (``self.wgrad``) so a zero-bubble schedule's B can defer their weight gradients to W.
        cp, cp_split: the context-parallel group and how sequences are divided over it.
        experts: the expert-parallel groups (:class:`mlmkit.moe.ExpertGroups`) of a mixture-of-experts
            model (``None``: every expert on this rank).

    forward(x, targets=None):
        first stage: ``x`` are token ids ``[b, s]``; other stages: hidden states ``[s, b, h]``
        (``[s/t, b, h]`` with SP) from the previous stage. Last stage: returns the loss over
        non-ignored targets ``[b, s]`` (mean, or sum with ``reduction="sum"``) when ``targets``
        is given, else the local logits
        ``[s, b, V/t]``. Other stages return hidden states for the next stage.
    """

    def __init__(self, config: GPTConfig, *, tp: Optional[CommGroup] = None, stage: Optional[Stage] = None,
                 sequence_parallel: bool = False, recompute: Union[bool, str] = False, device=None, dtype=None,
                 split_backward: bool = False, cp: Optional[CommGroup] = None, cp_split: str = "balanced",
                 experts=None):
        super().__init__()
        recompute = recompute_mode(recompute)
        self.wgrad = WeightGradStore() if split_backward else None
        tp = tp or _single_group()
        cp = cp or CommGroup.single("cp")
        stage = stage or Stage.whole(config)
        if experts is None and config.moe:
            from mlmkit.moe.layer import ExpertGroups

            experts = ExpertGroups.single()
        ep, etp = (experts.ep.size, experts.expert_tp.size) if experts is not None else (1, 1)
        config.check_parallel(tp=tp.size, sequence_parallel=sequence_parallel, cp=cp.size, cp_split=cp_split,
                              ep=ep, expert_tp=etp)
        self.experts_groups = experts
        self.config, self.tp, self.stage, self.sequence_parallel = config, tp, stage, sequence_parallel
        self.cp, self.cp_split = cp, cp_split
        # Seeded by the virtual stage: Megatron-LM's seeds for the first chunk of each pipeline rank
        # (its index is the rank); a rank's further chunks get their own streams, or two layers of
        # different chunks would drop the same elements (Megatron-LM's chunks share one advancing stream).
        self.rng = TPRandomState(seed=config.seed, tp_rank=tp.rank, pp_rank=stage.index, device=device)
        self.padded_vocab = config.padded_vocab(tp.size)
        self.vocab_start = tp.rank * (self.padded_vocab // tp.size)
        h, sp = config.hidden, sequence_parallel

        if stage.pre_process:
            self.embedding = VocabParallelEmbedding(
                self.padded_vocab, h, tp=tp, vocab_size=config.vocab_size, sequence_parallel=sp,
                init=self._word_init(), site="embedding.word", device=device)
            # Tied: its data-parallel gradient reduction is a bucket of its own, as the last stage's copy's
            # (mlmkit.data_parallel.grads), so that both copies are reduced alike, to the bit.
            self.embedding.weight.tied_embedding = config.tie_embeddings
            if config.position == "learned":
                pos = seeded_normal(config.seed, "embedding.position", config.init_std)((config.seq_len, h))
                self.position = mark_parameter(nn.Parameter(pos.to(device)), split_dim=None,
                                               global_shape=(config.seq_len, h), sequence_parallel=sp)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, layer=i, tp=tp, sequence_parallel=sp, rng=self.rng,
                                     recompute=recompute, device=device, wgrad=self.wgrad, cp=cp, cp_split=cp_split,
                                     experts=experts)
            for i in stage.layers
        })
        if stage.post_process:
            self.final_ln = make_norm(config, sequence_parallel=sp, device=device)
            if not (config.tie_embeddings and stage.pre_process):
                # Untied head, or the last stage's copy of the tied word embedding (kept in sync by
                # summing its gradient with the first stage's over the embedding group).
                init = self._word_init() if config.tie_embeddings else seeded_normal(
                    config.seed, "head.weight", config.init_std)
                full = _pad_rows(init((config.vocab_size, h)), self.padded_vocab)
                local = full.chunk(tp.size, dim=0)[tp.rank].clone()
                self.head_weight = mark_parameter(nn.Parameter(local.to(device)), split_dim=0,
                                                  global_shape=(self.padded_vocab, h))
                self.head_weight.shared_embedding = config.tie_embeddings
                self.head_weight.tied_embedding = config.tie_embeddings
        self._mark_vocab_rows()
        if dtype is not None:
            self.to(dtype)

    # ------------------------------------------------------------------ helpers
    def _word_init(self):
        base = seeded_normal(self.config.seed, "embedding.word", self.config.init_std)
        vocab, padded = self.config.vocab_size, self.padded_vocab
        return lambda shape: _pad_rows(base((vocab, shape[1])), padded)

    def _mark_vocab_rows(self) -> None:
        for p in self.vocab_parameters():
            p.vocab_rows = self.config.vocab_size  # rows beyond it are padding (zero, never used)

    def vocab_parameters(self) -> list[nn.Parameter]:
        out = []
        if self.stage.pre_process:
            out.append(self.embedding.weight)
        if hasattr(self, "head_weight"):
            out.append(self.head_weight)
        return out

    def head_weight_param(self) -> nn.Parameter:
        """The output head's ``[V/t, h]`` weight (the word embedding itself when tied on one stage)."""
        return self.head_weight if hasattr(self, "head_weight") else self.embedding.weight

    # ------------------------------------------------------------------ forward
    def local_positions(self, s: int) -> Optional[torch.Tensor]:
        """Positions (of a length-``s`` sequence) of the tokens this cp rank holds; ``None`` when cp = 1."""
        if self.cp.size == 1:
            return None
        from mlmkit.context_parallel.split import check_split, held_positions

        check_split(s, self.cp.size, self.cp_split, tp=self.tp.size, sequence_parallel=self.sequence_parallel)
        return torch.tensor(held_positions(s, self.cp.size, self.cp.rank, self.cp_split), dtype=torch.long,
                            device=self._device())

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` token ids -> ``[s, b, h]`` (``[s/t, b, h]`` with SP), position added, dropout.
        With context parallelism the whole sequences come in and this cp rank's tokens
        (``[b, s/cp]``) are embedded: ``[s/cp, b, h]`` (``[s/(cp t), b, h]`` with SP)."""
        b, s = tokens.shape
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds GPTConfig.seq_len={self.config.seq_len}")
        held = self.local_positions(s)
        if held is not None:
            tokens = tokens[:, held]
        x = self.embedding(tokens)
        if self.config.position == "learned":
            pos = self.position[:s] if held is None else self.position[held]
            s = pos.shape[0]
            if self.sequence_parallel and self.tp.size > 1:
                n = s // self.tp.size
                pos = pos[self.tp.rank * n:(self.tp.rank + 1) * n]
            x = x + pos.unsqueeze(1)
        gen = self.rng.tensor_parallel if self.sequence_parallel else self.rng.replicated
        return dropout(x, self.config.dropout, generator=gen, training=self.training)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and output projection: ``[s, b, h] -> [s, b, V/t]`` local logits."""
        x = self.final_ln(x)
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.tp, site="head")   # [s/t, b, h] -> [s, b, h]
        else:
            x = copy_to_tp(x, self.tp, site="head")
        return linear(x, self.head_weight_param(), None, self.wgrad)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy over non-ignored targets: their mean (``reduction="mean"``) or their sum
        (``"sum"``, for a per-token loss normalised over a whole batch); ``logits [s, b, V/t]``,
        ``targets [b, s]`` (with context parallelism: the whole sequences' targets, of which this cp
        rank's are used, or this rank's ``[b, s/cp]``; the loss then covers this rank's tokens)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'sum'")
        if self.cp.size > 1 and targets.shape[1] == logits.shape[0] * self.cp.size:
            targets = targets[:, self.local_positions(targets.shape[1])]
        per_token = vocab_parallel_cross_entropy(
            logits, targets.t(), tp=self.tp, vocab_start=self.vocab_start,
            vocab_size=self.config.vocab_size, ignore_index=ignore_index)
        if reduction == "sum":
            return per_token.sum()
        count = (targets != ignore_index).sum().clamp(min=1)
        return per_token.sum() / count

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
        if self.stage.pre_process:
            x = self.embed(x)
        rotary = self.rotary(self._sequence_length(x)) if self.config.position == "rope" else None
        for layer in self.layers.values():
            x = layer(x, rotary)
        if not self.stage.post_process:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        return self.loss(logits, targets, ignore_index=ignore_index, reduction=reduction)

    def _sequence_length(self, hidden: torch.Tensor) -> int:
        # The whole sequence's length: hidden is [s/cp, b, h], or [s/(cp t), b, h] with sequence
        # parallelism (attention sees the gathered local sequence).
        return hidden.shape[0] * (self.tp.size if self.sequence_parallel else 1) * self.cp.size

    def rotary(self, s: int, positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles of ``positions`` (default: the positions this rank holds
        of a length-``s`` sequence, ``0..s-1`` when cp = 1): ``[s/cp, d]``."""
        if positions is None:
            positions = self.local_positions(s)
        if positions is None:
            positions = torch.arange(s, device=self._device())
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Local ``[s, b, V/t]`` -> full ``[b, s, vocab_size]`` (padding dropped). For inspection and tests."""
        full = gather_from_tp(logits, self.tp, site="gather_logits")
        return full[..., : self.config.vocab_size].transpose(0, 1)

    def extra_repr(self) -> str:
        st = self.stage
        cp = f", cp={self.cp.size} (rank {self.cp.rank}, {self.cp_split})" if self.cp.size > 1 else ""
        return (f"layers={list(st.layers)}, pre_process={st.pre_process}, post_process={st.post_process}, "
                f"tp={self.tp.size} (rank {self.tp.rank}){cp}, sequence_parallel={self.sequence_parallel}")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def moe_layers(model: nn.Module) -> list:
    """The mixture-of-experts layers of ``model`` (empty for a dense model)."""
    from mlmkit.moe.layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]
