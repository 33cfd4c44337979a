"""Ring attention: causal self-attention over a sequence split across a context-parallel group.

Each cp rank holds the queries, keys and values of its own tokens (:mod:`mlmkit.context_parallel.split`).
The keys and values travel around the ring of cp ranks, one hop per step, while every rank
attends with its queries to the block it holds (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"; Megatron-LM / TransformerEngine's ``AttnFuncWithCPAndKVP2P``).

forward, at ring step ``j = 0 .. cp-1`` (rank ``r`` holds the keys/values of rank ``r - j``):
    post the exchange of the held key/value block (send to ``r + 1``, receive from ``r - 1``), then
    compute ``S = Q K_j^T / sqrt(d)`` on the step's segments (masked by position where a chunk
    meets itself), the block's log-sum-exp ``lse_j`` and output ``O_j = softmax(S) V_j``, and merge
    them into the running result (the online softmax of Milakov & Gimelshein 2018, as in
    FlashAttention): ``lse = log(e^lse + e^lse_j)``, ``O = O e^(lse_old - lse) + O_j e^(lse_j - lse)``;
    then wait for the next block. Keeps ``Q, K, V``, the output and ``lse`` (fp32) for backward; no
    ``s x s`` scores are stored.
backward, the same ring again: with ``P = exp(S - lse)`` recomputed per block and
    ``D = rowsum(dO * O)``: ``dV_j = P^T dO``, ``dS = P * (dO V_j^T - D)``, ``dQ += dS K_j / sqrt(d)``,
    ``dK_j = dS^T Q / sqrt(d)``. The key/value gradients of a block travel with it: each rank adds
    its part to the accumulator it received and sends it on; after ``cp`` hops every accumulator is
    back at its owner. Gradients are accumulated and sent in fp32.

Grouped-query attention is computed without copying keys and values per query head: queries are
viewed as ``[b, kv_heads, group, s, d]`` and broadcast against ``[b, kv_heads, 1, s, d]``.
Attention dropout is not supported (:meth:`GPTConfig.check_parallel` refuses ``dropout > 0`` with cp).

Wire bytes per rank, layer and microbatch: forward ``(cp - 1)`` messages of ``[2, b, kv/t, s/cp, d]``
(keys and values, training dtype), backward ``(cp - 1)`` such messages plus ``cp`` fp32 gradient
messages of the same shape (:mod:`mlmkit.estimate.comm` counts exactly these).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mlmkit.context_parallel.split import held_positions, ring_steps
from mlmkit.distributed import CommGroup

__all__ = ["Ring", "ring_attention"]


class Ring:
    """The context-parallel ring one attention call runs on: the cp group, the split and the
    sequence length (of the whole sequence), plus the label its trace rows carry."""

    def __init__(self, cp: CommGroup, *, seq_len: int, split: str = "balanced", site: str = "attn"):
        self.cp, self.seq_len, self.split, self.site = cp, seq_len, split, site
        self.steps = ring_steps(seq_len, cp.size, cp.rank, split)
        self.positions = [torch.tensor(held_positions(seq_len, cp.size, r, split)) for r in range(cp.size)]

    def record(self, phase: str, step: int, src: int, segments, start: float) -> None:
        tr = self.cp.tracer
        if tr is not None and tr.enabled:
            tr.record_ring(site=self.site, phase=phase, step=step, src=src,
                           pairs=sum(s.pairs for s in segments), start=start, end=tr.clock())

    def clock(self) -> float:
        tr = self.cp.tracer
        return tr.clock() if tr is not None else 0.0


def _mask(ring: Ring, src: int, seg, device) -> torch.Tensor:
    # True where the query (local row) may see the key (held column): key position <= query position.
    me = ring.positions[ring.cp.rank][seg.rows[0]:seg.rows[1]].to(device)
    them = ring.positions[src][seg.cols[0]:seg.cols[1]].to(device)
    return me[:, None] >= them[None, :]


def _scores(q, k, ring, src, seg, scale):
    # q [b, kv, g, sq, d] (rows of the segment), k [b, kv, sk, d] -> S [b, kv, g, sq, sk] fp32
    s = (q @ k[:, :, None].transpose(-1, -2)) * scale
    if seg.causal:
        s = s.masked_fill(~_mask(ring, src, seg, s.device), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        b, a, sl, d = q.shape
        kvh = k.shape[1]
        g = a // kvh
        scale = 1.0 / math.sqrt(d)
        qf = q.float().reshape(b, kvh, g, sl, d)
        out = torch.zeros(b, kvh, g, sl, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, kvh, g, sl), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                                            # [2, b, kv, sl, d]
        last = len(ring.steps) - 1
        for j, (src, segments) in enumerate(ring.steps):
            pending = ring.cp.ring_shift(kv, site=f"{ring.site}.kv", phase="forward", tag=0) if j < last else None
            t0 = ring.clock()
            kf, vf = kv[0].float(), kv[1].float()
            for seg in segments:
                r0, r1 = seg.rows
                c0, c1 = seg.cols
                s = _scores(qf[..., r0:r1, :], kf[:, :, c0:c1], ring, src, seg, scale)
                lse_j = torch.logsumexp(s, dim=-1)                          # [b, kv, g, sq]
                o_j = torch.exp(s - lse_j[..., None]) @ vf[:, :, None, c0:c1]   # [b, kv, g, sq, d]
                old = lse[..., r0:r1]
                new = torch.logaddexp(old, lse_j)
                out[..., r0:r1, :] = (out[..., r0:r1, :] * torch.exp(old - new)[..., None]
                                      + o_j * torch.exp(lse_j - new)[..., None])
                lse[..., r0:r1] = new
            ring.record("forward", j, src, segments, t0)
            if pending is not None:
                kv = pending.wait()
        result = out.reshape(b, a, sl, d).to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        b, a, sl, d = q.shape
        kvh = k.shape[1]
        g = a // kvh
        scale = 1.0 / math.sqrt(d)
        qf = q.float().reshape(b, kvh, g, sl, d)
        do = grad_out.float().reshape(b, kvh, g, sl, d)
        delta = (do * out.float().reshape(b, kvh, g, sl, d)).sum(-1)         # D = rowsum(dO * O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        last = len(ring.steps) - 1
        dkv_pending = None
        for j, (src, segments) in enumerate(ring.steps):
            kv_pending = ring.cp.ring_shift(kv, site=f"{ring.site}.kv", phase="backward", tag=0) if j < last else None
            t0 = ring.clock()
            kf, vf = kv[0].float(), kv[1].float()
            part = torch.zeros(2, b, kvh, sl, d, dtype=torch.float32, device=q.device)  # dK, dV of this block
            for seg in segments:
                r0, r1 = seg.rows
                c0, c1 = seg.cols
                qs = qf[..., r0:r1, :]
                s = _scores(qs, kf[:, :, c0:c1], ring, src, seg, scale)
                p = torch.exp(s - lse[..., r0:r1, None])                    # [b, kv, g, sq, sk]
                dos = do[..., r0:r1, :]
                part[1, :, :, c0:c1] += (p.transpose(-1, -2) @ dos).sum(2)  # dV
                dp = dos @ vf[:, :, None, c0:c1].transpose(-1, -2)
                ds = p * (dp - delta[..., r0:r1, None])
                dq[..., r0:r1, :] += (ds @ kf[:, :, None, c0:c1]) * scale
                part[0, :, :, c0:c1] += (ds.transpose(-1, -2) @ qs).sum(2) * scale   # dK
            ring.record("backward", j, src, segments, t0)
            # The block's gradient accumulator arrives from the previous rank (which held this block
            # one step earlier); add this rank's part and pass it on.
            acc = part if dkv_pending is None else dkv_pending.wait() + part
            if ring.cp.size > 1:
                dkv_pending = ring.cp.ring_shift(acc, site=f"{ring.site}.dkv", phase="backward", tag=1)
            else:
                own = acc
            if kv_pending is not None:
                kv = kv_pending.wait()
        if ring.cp.size > 1:
            own = dkv_pending.wait()                                        # this rank's block, all parts summed
        dq = dq.reshape(b, a, sl, d).to(q.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    ``q [b, a, s/cp, d]``, ``k, v [b, kv, s/cp, d]`` (``a`` divisible by ``kv``), each rank's tokens
    at the positions :func:`~mlmkit.context_parallel.split.held_positions` gives (rotary embedding
    already applied). Returns ``[b, a, s/cp, d]``, what ``scaled_dot_product_attention(...,
    is_causal=True)`` on the full sequence returns at this rank's positions. Collective over the cp
    group: every member calls it for the same layer at the same time."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {q.shape[1]} query heads do not group over {k.shape[1]} key/value heads")
    expected = ring.seq_len // ring.cp.size
    if q.shape[2] != expected:
        raise ValueError(f"ring_attention: local sequence of {q.shape[2]} tokens, expected seq_len/cp = {expected}")
    return _RingAttention.apply(q, k, v, ring)


def sequence_positions(seq_len: int, cp: CommGroup, split: str = "balanced",
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """This rank's token positions as a LongTensor (what the model indexes tokens, targets and
    position tables with)."""
    return torch.tensor(held_positions(seq_len, cp.size, cp.rank, split), dtype=torch.long, device=device)
