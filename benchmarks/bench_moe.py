"""The mixture-of-experts layer at ep=2 against the same layer in plain PyTorch on one rank, and its
dispatch all-to-all against the gloo all-to-all floor.

Layer: 8 SwiGLU experts (h=256, expert ffn 512), top-2, softmax router, 2048 tokens per step in
all, forward and backward. mlmkit: :class:`mlmkit.moe.MoELayer` on 2 ranks (gloo, one thread each),
each routing its 1024 tokens and holding 4 experts; the step takes as long as the slower rank.
Baseline: a plain PyTorch layer on one rank (one thread) with the same weights and the same 2048
tokens: ``nn.Linear`` router, softmax, top-k, a loop over experts with boolean masks, ``index_add``.
Both sides do the same arithmetic; ep=2 has two cores for it and pays the all-to-alls.

Floor: ``all_to_all_single`` of the same bytes per peer, alone, in a loop on the same 2 ranks; the
dispatch's median time (from its trace rows, forward) over that.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Row, median
from mlmkit.distributed import run_ranks
from mlmkit.model.config import moe_config

MODEL = moe_config(hidden=256, heads=8, kv_heads=2, layers=1, ffn_hidden=512, experts=8, top_k=2, seq_len=256)
TOKENS = 2048


class PlainMoE(torch.nn.Module):
    """A mixture of experts as one would write it in plain PyTorch on one device."""

    def __init__(self, router_weight, experts):
        super().__init__()
        self.router = torch.nn.Linear(router_weight.shape[1], router_weight.shape[0], bias=False)
        self.router.weight.data.copy_(router_weight)
        self.fc1 = torch.nn.ModuleList(torch.nn.Linear(w1.shape[1], w1.shape[0], bias=False) for w1, _ in experts)
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(w2.shape[1], w2.shape[0], bias=False) for _, w2 in experts)
        for lin, (w1, w2) in zip(zip(self.fc1, self.fc2), experts):
            lin[0].weight.data.copy_(w1)
            lin[1].weight.data.copy_(w2)

    def forward(self, x, k):
        probs = self.router(x).float().softmax(-1)
        w, idx = probs.topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(len(self.fc1)):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = self.fc1[e](x[tok]).chunk(2, dim=-1)
            y = self.fc2[e](torch.nn.functional.silu(gate) * up)
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def _plain(rank, world_size, reps):
    from mlmkit.moe.layer import MoELayer
    from mlmkit.distributed import CommGroup

    torch.set_num_threads(1)
    full = MoELayer(MODEL, layer=0, tp=CommGroup.single("tp"), sequence_parallel=False)
    experts = [(full.experts[str(e)].fc1.weight.detach(), full.experts[str(e)].fc2.weight.detach())
               for e in range(MODEL.experts)]
    plain = PlainMoE(full.router.weight.detach(), experts)
    x = torch.randn(TOKENS, MODEL.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ref = full(x.view(TOKENS, 1, -1)).view(TOKENS, -1)
    assert torch.allclose(plain(x, MODEL.top_k), ref, atol=1e-5)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        plain(x, MODEL.top_k).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def _ep2(rank, world_size, reps):
    import torch.distributed as dist

    from mlmkit import Topology
    from mlmkit.distributed import ProcessGroups
    from mlmkit.moe.layer import MoELayer
    from mlmkit.trace import Tracer

    groups = ProcessGroups.build(Topology(dp=2, ep=2))
    tracer = Tracer(rank=rank)
    groups.set_tracer(tracer)
    layer = MoELayer(MODEL, layer=0, tp=groups.tp, sequence_parallel=False, groups=groups.expert_groups())
    x = torch.randn(TOKENS, MODEL.hidden, generator=torch.Generator().manual_seed(0))
    mine = x[rank * TOKENS // 2:(rank + 1) * TOKENS // 2].clone().requires_grad_(True)
    times = []
    for i in range(reps + 2):
        tracer.clear()
        dist.barrier()
        t0 = time.perf_counter()
        layer(mine.view(-1, 1, MODEL.hidden)).sum().backward()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(t))
    comm = tracer.comm_frame()
    dispatch = comm[(comm.site == "layers.0.mlp.dispatch") & (comm.phase == "forward")]
    nbytes = int(dispatch.bytes.iloc[0])
    dispatch_time = float((dispatch.end - dispatch.start).median())
    # the floor: the same bytes to the peer, nothing else running
    agreed = torch.tensor([nbytes // (MODEL.hidden * 4)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)          # both ranks exchange the same sizes
    rows = int(agreed)
    buf = torch.randn(2 * rows, MODEL.hidden)
    out = torch.empty_like(buf)
    floor = []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, buf, output_split_sizes=[rows, rows], input_split_sizes=[rows, rows])
        if i >= 2:
            floor.append(time.perf_counter() - t0)
    return times, dispatch_time, median(floor), nbytes


def run(quick: bool = False) -> list[Row]:
    reps = 5 if quick else 15
    plain = run_ranks(_plain, world_size=1, args=(reps,), timeout_s=600)[0]
    ep2, dispatch, floor, nbytes = run_ranks(_ep2, world_size=2, args=(reps,), timeout_s=600)[0]
    return [
        Row("MoE layer at ep=2 vs plain PyTorch (1 rank)",
            f"8 SwiGLU experts h=256 ffn=512, top-2, {TOKENS} tokens, fwd+bwd; ep=2: 2 ranks x 1 thread",
            median(ep2) * 1e3, median(plain) * 1e3, "ms", "n/a (reported)", None,
            note="same arithmetic; ep=2 spreads it over 2 cores and pays two all-to-alls each way"),
        Row("MoE dispatch all-to-all vs gloo floor",
            f"{nbytes / 2**10:.0f} KiB to the peer per dispatch, 2 ranks", dispatch * 1e3, floor * 1e3, "ms",
            "n/a (reported)", None, note="median of the dispatch's traced forward rows over a bare all_to_all_single"),
    ]
