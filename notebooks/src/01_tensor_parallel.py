# %% [markdown]
# # 01 · Tensor parallelism, step by step
#
# Megatron-LM (Shoeybi et al. 2019) splits each layer's weight matrices across `t` ranks:
#
# * **ColumnParallelLinear** `A = [A_1, A_2]` split by output columns: rank *i* computes `X A_i`.
#   The input enters the TP region through **f** (identity forward, all-reduce backward).
# * **RowParallelLinear** `B = [B_1; B_2]` split by input rows: rank *i* computes `Y_i B_i`, then
#   **g** sums the partial results (all-reduce forward, identity backward).
#
# A column→row pair (the MLP, or attention with heads split) costs one all-reduce forward and one
# backward. Here we run both on **2 ranks** and check every number against the serial layer.

# %%
import torch
import torch.nn.functional as F
from mlmkit import Topology
from mlmkit.cluster import Cluster

cluster = Cluster(topology=Topology(tp=2)).start()
cluster

# %% [markdown]
# Build the same MLP on both ranks. Weights come from a seed at full size and are then sliced, so the pair equals the serial MLP. (`cluster.run` ships a notebook function to every engine; `torch` is imported there, anything else is imported inside the function.)

# %%
def build_mlp(r, h=64, ffn=256):
    from mlmkit.model import seeded_normal
    from mlmkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from mlmkit.trace import Tracer
    tracer = Tracer(rank=r.rank)
    r.groups.set_tracer(tracer)
    fc1 = ColumnParallelLinear(h, ffn, tp=r.groups.tp, init=seeded_normal(0, "fc1", 0.02), site="mlp.fc1")
    fc2 = RowParallelLinear(ffn, h, tp=r.groups.tp, init=seeded_normal(0, "fc2", 0.02), site="mlp.fc2")
    r.data.update(fc1=fc1, fc2=fc2, tracer=tracer)
    from mlmkit.model import shard_table
    return shard_table(torch.nn.ModuleDict({"fc1": fc1, "fc2": fc2}), rank=r.rank)

shards = cluster.run_frame(build_mlp)
shards

# %% [markdown]
# Shard shapes: fc1 keeps 128 of 256 output rows per rank (split dim 0), fc2 keeps 128 of 256 input columns (split dim 1); fc2's bias is replicated and added after the sum.

# %%
from mlmkit.viz import shard_figure
shard_figure(shards)

# %% [markdown]
# The same as a picture: each weight at its full shape, cut into the blocks the two ranks hold.

# %%
from mlmkit.viz import shard_matrix_figure
shard_matrix_figure(shards)

# %% [markdown]
# Forward and backward on the same input `x` of shape `[s, b, h] = [8, 2, 64]` on every rank.

# %%
def run_mlp(r):
    import torch.nn.functional as F           # engines run the function: import what it uses inside
    fc1, fc2, tracer = r.data["fc1"], r.data["fc2"], r.data["tracer"]
    tracer.clear()
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = fc2(F.gelu(fc1(x)))           # f (identity) -> local matmuls -> g (all-reduce)
    y.sum().backward()                # g (identity) -> local grads -> f (all-reduce of dL/dx)
    return {"y": y.detach(), "x_grad": x.grad, "fc1_grad": fc1.weight.grad, "comm": tracer.comm_frame()}

out = cluster.run(run_mlp)
out[0]["comm"][["rank", "op", "axis", "bytes", "wire_bytes", "site", "phase"]]

# %% [markdown]
# Exactly two all-reduces of `[s, b, h]` (8·2·64·4 = 4096 bytes): **g** in forward (site `mlp.fc2`) and **f** in backward (site `mlp.fc1`). Now the serial reference:

# %%
from mlmkit.model import seeded_normal
x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
W1, W2 = seeded_normal(0, "fc1", 0.02)((256, 64)), seeded_normal(0, "fc2", 0.02)((64, 256))
W1.requires_grad_(); W2.requires_grad_()
y = F.linear(F.gelu(F.linear(x, W1)), W2)
y.sum().backward()

for rank in (0, 1):
    assert (out[rank]["y"] - y.detach()).abs().max() < 1e-5                 # same output on both ranks
    assert (out[rank]["x_grad"] - x.grad).abs().max() < 1e-5                # f summed the input gradient
full_fc1_grad = torch.cat([out[0]["fc1_grad"], out[1]["fc1_grad"]], dim=0)  # column shards stack back
assert (full_fc1_grad - W1.grad).abs().max() < 1e-5
print("max |y - y_serial| =", float((out[0]["y"] - y).abs().max()))

# %% [markdown]
# ## Attention with heads split
# `ParallelAttention` splits the 4 heads 2 + 2: the fused QKV weight is laid out per head so that a
# contiguous slice gives each rank whole heads. Same check against the serial module (tp = 1).

# %%
def run_attention(r):
    from mlmkit.model import tiny_config
    from mlmkit.model.gpt import ParallelAttention
    from mlmkit.tensor_parallel import TPRandomState
    cfg = tiny_config()
    attn = ParallelAttention(cfg, layer=0, tp=r.groups.tp, sequence_parallel=False,
                             rng=TPRandomState(seed=0, tp_rank=r.groups.tp.rank))
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1))
    return {"out": attn(x).detach(), "heads_here": attn.heads_local, "qkv_local": tuple(attn.qkv.weight.shape)}

att = cluster.run(run_attention)
from mlmkit.model import tiny_config
from mlmkit.model.gpt import ParallelAttention
from mlmkit.distributed import CommGroup
from mlmkit.tensor_parallel import TPRandomState
serial = ParallelAttention(tiny_config(), layer=0, tp=CommGroup.single("tp"), sequence_parallel=False,
                           rng=TPRandomState(seed=0))
ref = serial(torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1))).detach()
for rank in (0, 1):
    assert (att[rank]["out"] - ref).abs().max() < 1e-5
{rank: (v["heads_here"], v["qkv_local"]) for rank, v in att.items()}

# %% [markdown]
# ## Grouped-query attention: fewer key/value heads than ranks
# Llama-style models share each key/value head between several query heads (Ainslie et al. 2023).
# Query heads split over tp as before; key/value heads split too when `tp <= kv_heads`, and when
# `tp > kv_heads` each one is **replicated** on the `tp / kv_heads` ranks whose query heads use it,
# as Megatron-LM does. A replica only sees its own query heads' share of the key/value gradient, so
# the replicas' weight gradients are **summed** after backward.
#
# How are Llama 3 70B's 8 KV heads laid out over tp = 16? The planning layer answers without
# allocating anything:

# %%
import pandas as pd
from mlmkit.model.presets import preset
from mlmkit.estimate import local_parameters
llama70 = preset("llama3-70b")
t = 16
kv = next(p for p in local_parameters(llama70, Topology(tp=t), pp_rank=0) if p.name == "layers.0.attn.kv.weight")
q_per_rank = llama70.heads // t
pd.DataFrame([{"tp rank": r, "query heads": f"{r * q_per_rank}-{(r + 1) * q_per_rank - 1}",
               "kv head held": r // kv.replicas, "kv weight elements": kv.numel} for r in range(t)]).set_index("tp rank").T

# %% [markdown]
# Each KV head sits on 2 ranks (`replicas = 16 / 8`), the 8 query heads of a KV group on those 2 ranks. Now on our 2 ranks: multi-query attention (1 KV head, replicated on both) against the serial layer, gradients included.

# %%
def run_mqa(r):
    from mlmkit.model.config import llama_config
    from mlmkit.model.gpt import ParallelAttention
    from mlmkit.tensor_parallel import TPRandomState, sync_replicated_grads
    cfg = llama_config(kv_heads=1)                     # 4 query heads, 1 key/value head
    attn = ParallelAttention(cfg, layer=0, tp=r.groups.tp, sequence_parallel=False,
                             rng=TPRandomState(seed=0, tp_rank=r.groups.tp.rank))
    x = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(2))
    y = attn(x)
    y.sum().backward()
    partial = attn.kv.weight.grad.clone()
    sync_replicated_grads(attn, r.groups.tp)           # sum over the ranks holding this head
    return {"out": y.detach(), "kv_shape": tuple(attn.kv.weight.shape), "replicas": attn.kv.weight.tp_replicas,
            "partial": partial, "kv_grad": attn.kv.weight.grad}

mqa = cluster.run(run_mqa)
from mlmkit.model.config import llama_config
serial_mqa = ParallelAttention(llama_config(kv_heads=1), layer=0, tp=CommGroup.single("tp"), sequence_parallel=False,
                               rng=TPRandomState(seed=0))
y_ref = serial_mqa(torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(2)))
y_ref.sum().backward()
for rank in (0, 1):
    assert (mqa[rank]["out"] - y_ref.detach()).abs().max() < 1e-5
    assert (mqa[rank]["kv_grad"] - serial_mqa.kv.weight.grad).abs().max() < 1e-5     # after the sum
assert (mqa[0]["partial"] - serial_mqa.kv.weight.grad).abs().max() > 1e-4           # before it: a part only
{rank: (v["kv_shape"], v["replicas"]) for rank, v in mqa.items()}

# %% [markdown]
# ## SwiGLU: gate and up projections split into matching halves
# `fc2(silu(gate x) * up x)`: the product is elementwise, so rank *i* needs the *same* rows of gate
# and up. With the fused `fc1 = [gate; up]` each half is split over tp separately (`partitions = 2`):
# rank *i* holds `[gate_i; up_i]` and needs no communication before fc2.

# %%
def swiglu_shards(r):
    from mlmkit.model.config import llama_config
    from mlmkit.model.gpt import ParallelMLP
    from mlmkit.model import shard_table
    from mlmkit.tensor_parallel import TPRandomState
    mlp = ParallelMLP(llama_config(), layer=0, tp=r.groups.tp, sequence_parallel=False,
                      rng=TPRandomState(seed=0, tp_rank=r.groups.tp.rank))
    return shard_table(mlp, rank=r.rank)[["rank", "name", "local_shape", "global_shape", "split_dim", "partitions",
                                          "tp_rank", "tp_size"]]

cluster.run_frame(swiglu_shards)

# %% [markdown]
# **Bytes moved.** Per Transformer layer and microbatch: 2 all-reduces forward (attention, MLP) and 2
# backward, each of `[s, b, h]`; a ring all-reduce sends `2(t-1)/t` of the tensor per rank.
# With sequence parallelism they become all-gathers and reduce-scatters of the same total volume.
# Grouped-query attention and SwiGLU change none of this (q and kv, gate and up, share one **f**);
# replicated key/value heads add one gradient sum per step.

# %%
cluster.shutdown()

# %% [markdown]
# ## What this showed
# * A column-parallel layer followed by a row-parallel one needs a single all-reduce in forward (and
#   one in backward): Megatron-LM's f and g operators.
# * Each rank holds `1/t` of the weights; the results equal the serial layer's.
# * Grouped-query attention replicates key/value heads when tp exceeds their count.
#
# ## Exercises (predict, then check)
# 1. With hidden 64, MLP width 256 and tp = 2, what is the shape of a rank's fc1 weight (out, in)?
# 2. How many all-reduces does a column->row MLP run in its forward?
# 3. How many bytes does that all-reduce carry for s = 16, b = 4, h = 64 in fp32?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
import torch
from mlmkit.distributed import CommGroup, ProcessGroups
from mlmkit.tensor_parallel import ColumnParallelLinear
from mlmkit.trace import Tracer
SHOW_ANSWERS = False
fc1 = ColumnParallelLinear(64, 256, tp=CommGroup(axis="tp", ranks=[0, 1], global_rank=1, pg=None))
answers = {1: tuple(fc1.weight.shape), 2: 1, 3: 16 * 4 * 64 * 4}
assert answers == {1: (128, 64), 2: 1, 3: 16384}
if SHOW_ANSWERS:
    print(answers)
