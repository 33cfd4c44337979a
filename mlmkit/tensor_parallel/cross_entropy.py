"""Cross-entropy over a vocabulary split across TP ranks, without ever gathering the logits.

Each rank holds logits ``[s, b, V/t]`` for its vocabulary slice. Three all-reduces of ``[s, b]``
tensors replace a gather of ``[s, b, V]`` (Shoeybi et al. 2019, section 3, "we fuse the output
embedding GEMM with the cross-entropy loss"):

1. the maximum logit (for numerical stability), all-reduce MAX;
2. the logit of the target token (non-zero on the one rank that owns it), all-reduce SUM;
3. the sum of ``exp(logit - max)``, all-reduce SUM.

``loss = log(sum_exp) - target_logit``. backward: ``softmax - one_hot(target)`` computed locally on
each slice; no communication.

Padded vocabulary columns (ids ``>= vocab_size``, added so that the vocabulary divides by ``t``) are
masked to ``-inf`` so that the loss is exactly that of the unpadded model, whatever ``t`` is.
(Megatron-LM leaves them as trainable dead columns; masking keeps every TP degree the same function.)
"""

from __future__ import annotations

import torch

from mlmkit.distributed import CommGroup

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index, site):
        # logits [..., V/t] (float), targets [...] (int64)
        v_local = logits.shape[-1]
        logits_max = logits.max(dim=-1).values                       # [...]
        group.all_reduce(logits_max, op="max", site=site, phase="forward")
        shifted = logits - logits_max.unsqueeze(-1)                  # [..., V/t]

        ignored = targets == ignore_index
        outside = (targets < vocab_start) | (targets >= vocab_start + v_local) | ignored
        local_target = (targets - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)        # [...]
        group.all_reduce(target_logit, site=site, phase="forward")

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)                                    # [...]
        group.all_reduce(sum_exp, site=site, phase="forward")

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()                                       # d loss / d logits = p - y
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, tp: CommGroup,
                                 vocab_start: int, vocab_size: int, ignore_index: int = -100,
                                 site: str = "loss") -> torch.Tensor:
    """Per-token loss ``[...]`` (0 where ``targets == ignore_index``) from split logits ``[..., V/t]``.

    Args:
        logits: this rank's slice of the logits, columns ``[vocab_start, vocab_start + V/t)``.
        targets: token ids, same leading shape.
        tp: the TP group over which the vocabulary is split.
        vocab_size: the real (unpadded) vocabulary; columns at or beyond it are masked out.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {list(logits.shape)} and targets {list(targets.shape)} "
            f"must agree in every dimension but the last"
        )
    # A target outside the vocabulary fell outside every rank's slice and counted as a logit of 0: a
    # loss of no model, without an error (torch's cross_entropy raises).
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"target id {int(targets[bad][0])} is outside the vocabulary [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index}; check the targets against GPTConfig.vocab_size")
    logits = logits.float()
    v_local = logits.shape[-1]
    if vocab_start + v_local > vocab_size:  # this slice has padded columns
        cols = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_start, ignore_index, site)
