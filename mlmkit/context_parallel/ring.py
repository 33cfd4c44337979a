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

Each block is computed by PyTorch's flash-attention kernel on CPU (which returns the block's
log-sum-exp, and in backward takes the merged output and log-sum-exp, so it yields the final
probabilities' gradients), elsewhere by the same formulas written out in fp32. With grouped-query
attention each key/value head is repeated for its query heads inside a block and the gradients of
the copies summed.
Attention dropout is not supported (:meth:`GPTConfig.check_parallel` refuses ``dropout > 0`` with cp).

Wire bytes per rank, layer and microbatch: forward ``(cp - 1)`` messages of ``[2, b, kv/t, s/cp, d]``
(keys and values, training dtype), backward ``(cp - 1)`` such messages plus ``cp`` fp32 gradient
messages of the same shape (:mod:`mlmkit.estimate.comm` counts exactly these).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from mlmkit.context_parallel.split import held_positions, ring_steps
from mlmkit.distributed import CommGroup

__all__ = ["Ring", "allgather_attention", "ring_attention"]


class Ring:
    """The context-parallel ring one attention call runs on: the cp group, the split and the
    sequence length (of the whole sequence), plus the label its trace rows carry. ``kernel``:
    ``"auto"`` computes blocks with PyTorch's CPU flash-attention kernel where it applies,
    ``"math"`` always with the written-out formulas."""

    def __init__(self, cp: CommGroup, *, seq_len: int, split: str = "balanced", site: str = "attn",
                 kernel: str = "auto"):
        if kernel not in ("auto", "math"):
            raise ValueError(f"Ring: kernel={kernel!r}: expected 'auto' (PyTorch's flash kernel where it exists) "
                             f"or 'math' (the formulas in fp32)")
        self.cp, self.seq_len, self.split, self.site, self.kernel = cp, seq_len, split, site, kernel
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


def _fused(q: torch.Tensor, seg, ring: Ring) -> bool:
    # CPU: PyTorch's flash-attention kernels return the log-sum-exp and take it back in backward.
    # A causal segment is always a square diagonal block (positions increase along the local
    # sequence), so the kernel's own causal mask is the position mask.
    return (ring.kernel == "auto" and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and (not seg.causal or seg.rows[1] - seg.rows[0] == seg.cols[1] - seg.cols[0]))


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    # [b, kv, s, d] -> [b, kv * groups, s, d]: each key/value head once per query head that uses it
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _block_forward(q, k, v, ring, src, seg, scale, groups):
    """One segment: ``q [b, a, sq, d]``, ``k, v [b, kv, sk, d]`` -> output ``[b, a, sq, d]`` (fp32)
    and log-sum-exp ``[b, a, sq]`` (fp32) of the segment alone."""
    if _fused(q, seg, ring):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand(k, groups), _expand(v, groups), 0.0, seg.causal, scale=scale)
        return o.float(), lse
    b, a, sq, d = q.shape
    qf = q.float().reshape(b, a // groups, groups, sq, d)
    s = (qf @ k.float()[:, :, None].transpose(-1, -2)) * scale                 # [b, kv, g, sq, sk]
    if seg.causal:
        s = s.masked_fill(~_mask(ring, src, seg, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ v.float()[:, :, None]
    return o.reshape(b, a, sq, d), lse.reshape(b, a, sq)


def _block_backward(do, q, k, v, out, lse, ring, src, seg, scale, groups):
    """Gradients of one segment given the *merged* output and log-sum-exp of the whole ring (so
    ``P = exp(S - lse)`` are the final probabilities): ``dq [b, a, sq, d]``, ``dk, dv [b, kv, sk, d]``
    (fp32)."""
    if _fused(q, seg, ring):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, _expand(k, groups), _expand(v, groups), out, lse, 0.0, seg.causal, scale=scale)
        if groups > 1:   # sum over the query heads that share a key/value head
            b, a, sk, d = dk.shape
            dk = dk.reshape(b, a // groups, groups, sk, d).sum(2)
            dv = dv.reshape(b, a // groups, groups, sk, d).sum(2)
        return dq.float(), dk.float(), dv.float()
    b, a, sq, d = q.shape
    kvh = a // groups
    qf = q.float().reshape(b, kvh, groups, sq, d)
    dof = do.float().reshape(b, kvh, groups, sq, d)
    delta = (dof * out.float().reshape(b, kvh, groups, sq, d)).sum(-1)          # D = rowsum(dO * O)
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]
    s = (qf @ kf.transpose(-1, -2)) * scale
    if seg.causal:
        s = s.masked_fill(~_mask(ring, src, seg, s.device), float("-inf"))
    p = torch.exp(s - lse.reshape(b, kvh, groups, sq)[..., None])               # [b, kv, g, sq, sk]
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    ds = p * (dof @ vf.transpose(-1, -2) - delta[..., None])
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    return dq.reshape(b, a, sq, d), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        b, a, sl, d = q.shape
        groups = a // k.shape[1]
        scale = 1.0 / math.sqrt(d)
        out = torch.zeros(b, a, sl, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, a, sl), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                                            # [2, b, kv, sl, d]
        last = len(ring.steps) - 1
        for j, (src, segments) in enumerate(ring.steps):
            pending = ring.cp.ring_shift(kv, site=f"{ring.site}.kv", phase="forward", tag=0) if j < last else None
            t0 = ring.clock()
            for seg in segments:
                (r0, r1), (c0, c1) = seg.rows, seg.cols
                o_j, lse_j = _block_forward(q[:, :, r0:r1], kv[0][:, :, c0:c1], kv[1][:, :, c0:c1], ring, src, seg,
                                            scale, groups)
                old = lse[..., r0:r1]
                new = torch.logaddexp(old, lse_j)
                out[..., r0:r1, :] = (out[..., r0:r1, :] * torch.exp(old - new)[..., None]
                                      + o_j * torch.exp(lse_j - new)[..., None])
                lse[..., r0:r1] = new
            ring.record("forward", j, src, segments, t0)
            if pending is not None:
                kv = pending.wait()
        result = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        b, a, sl, d = q.shape
        kvh = k.shape[1]
        groups = a // kvh
        scale = 1.0 / math.sqrt(d)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(b, a, sl, d, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        last = len(ring.steps) - 1
        dkv_pending, own = None, None
        for j, (src, segments) in enumerate(ring.steps):
            kv_pending = ring.cp.ring_shift(kv, site=f"{ring.site}.kv", phase="backward", tag=0) if j < last else None
            t0 = ring.clock()
            part = torch.zeros(2, b, kvh, sl, d, dtype=torch.float32, device=q.device)  # dK, dV of this block
            for seg in segments:
                (r0, r1), (c0, c1) = seg.rows, seg.cols
                dq_j, dk_j, dv_j = _block_backward(
                    grad_out[:, :, r0:r1], q[:, :, r0:r1], kv[0][:, :, c0:c1], kv[1][:, :, c0:c1],
                    out[:, :, r0:r1], lse[..., r0:r1], ring, src, seg, scale, groups)
                dq[:, :, r0:r1] += dq_j
                part[0, :, :, c0:c1] += dk_j
                part[1, :, :, c0:c1] += dv_j
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
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


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


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """The all-gather alternative to the ring (Llama 3's context parallelism): every rank gathers
    all keys and values of the cp group (one all-gather; backward: a reduce-scatter of their
    gradients) and attends with its queries under a position mask. Same inputs and result as
    :func:`ring_attention`; it moves the same bytes in one collective, without overlap, and keeps
    the gathered keys and values (``cp`` times more) for backward. mlmkit's benchmark compares the
    two (``make bench``)."""
    from mlmkit.tensor_parallel.comm import gather_from_sequence

    def gather(t):   # [b, kv, s/cp, d] -> [s, b, kv, d] in group order (held chunks of rank 0, 1, ...)
        return gather_from_sequence(t.permute(2, 0, 1, 3), ring.cp, site=f"{ring.site}.allgather")

    kf, vf = (gather(t).permute(1, 2, 0, 3) for t in (k, v))                 # [b, kv, s, d]
    mine = ring.positions[ring.cp.rank].to(q.device)
    every = torch.cat(ring.positions).to(q.device)
    mask = mine[:, None] >= every[None, :]                                   # [s/cp, s]
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
