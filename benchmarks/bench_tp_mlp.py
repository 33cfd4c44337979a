"""Column -> row parallel MLP at tp=2: mlmkit's layers against DTensor's ColwiseParallel/RowwiseParallel.

Same full weights on both sides, same input; forward + backward per iteration, both sides
alternated in one process per rank. Time per iteration = the slower rank's.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Row, alternate, paired
from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import seeded_normal
from mlmkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class _MlmkitMLP(nn.Module):
    def __init__(self, h, ffn, tp):
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, ffn, tp=tp, init=seeded_normal(0, "fc1", 0.02), site="fc1")
        self.fc2 = RowParallelLinear(ffn, h, tp=tp, init=seeded_normal(0, "fc2", 0.02), site="fc2")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _rank(rank, world_size, reps, s, b, h, ffn):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    groups = ProcessGroups.build(Topology(tp=world_size))
    ours = _MlmkitMLP(h, ffn, groups.tp)
    ref = nn.Sequential(OrderedDict(fc1=nn.Linear(h, ffn), act=nn.GELU(), fc2=nn.Linear(ffn, h)))
    with torch.no_grad():
        ref.fc1.weight.copy_(seeded_normal(0, "fc1", 0.02)((ffn, h)))
        ref.fc2.weight.copy_(seeded_normal(0, "fc2", 0.02)((h, ffn)))
        ref.fc1.bias.zero_()
        ref.fc2.bias.zero_()
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(ref, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1))
    y_ours, y_ref = ours(x), ref(x)
    assert torch.allclose(y_ours, y_ref.full_tensor() if hasattr(y_ref, "full_tensor") else y_ref, atol=1e-5)

    def one(model):
        dist.barrier()
        t0 = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - t0

    return alternate(lambda: one(ours), lambda: one(ref), reps, warmup=3)


def run(quick: bool = False) -> list[Row]:
    reps = 20 if quick else 80
    res = run_ranks(_rank, world_size=2, args=(reps, 64, 4, 256, 1024), timeout_s=600)
    ours, ref, ratio = paired([max(a, b) for a, b in zip(res[0][0], res[1][0])],
                              [max(a, b) for a, b in zip(res[0][1], res[1][1])])
    return [Row("TP column->row MLP vs DTensor", "tp=2, [s=64,b=4,h=256], ffn 1024, fwd+bwd",
                ours * 1e3, ref * 1e3, "ms", "<= 1.0", ratio <= 1.0, ratio=ratio)]
