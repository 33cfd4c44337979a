# %% [markdown]
# # 07 · Mixture of experts: routing, all-to-all and load balance, per rank
#
# A **mixture of experts** (MoE) replaces each dense MLP by `E` expert MLPs and a **router**: a linear
# layer scores every token against every expert, the token goes to its `top_k` best experts, and its
# output is their outputs weighted by the router (Shazeer et al. 2017; GShard 2020; Switch 2021;
# Mixtral 2024). Parameters grow with `E`, the work per token only with `top_k`.
#
# **Expert parallelism** (ep) puts `E / ep` experts on each rank. Every MoE layer then moves tokens
# twice: an **all-to-all dispatch** sends each token to the ranks holding its experts, and an
# **all-to-all combine** brings the results back. Nothing forces the router to spread tokens evenly:
# a **load-balancing loss** (Switch/GShard) pushes it to, and a **capacity factor** can cap what each
# expert takes (the rest is *dropped*: it skips the experts and keeps only its residual).
#
# This notebook trains a tiny MoE with ep = 2 and ep = 4 on the cluster, checks it against the serial
# model, and shows where the tokens go, what the all-to-alls move, and what the balance loss and a
# capacity do. Runs on a laptop in about two minutes.

# %%
import dataclasses
import pandas as pd
import plotly.io as pio
pio.renderers.default = "notebook"
import torch
from mlmkit.estimate import estimate_train_comm, moe_parameter_counts
from mlmkit.estimate.compare import compare_comm
from mlmkit.estimate.flops import forward_flops_per_token
from mlmkit.model.config import moe_config
from mlmkit.moe import route
from mlmkit.train import TrainConfig
from mlmkit.viz import all_to_all_figure, expert_load, expert_load_figure, moe_training_figure

model = moe_config(seq_len=32, hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=64, experts=4, top_k=2)
dense = dataclasses.replace(model, experts=0, top_k=1)
rows = {"dense model": (moe_parameter_counts(dense)["total"], forward_flops_per_token(dense)["total"]),
        "MoE, all parameters": (moe_parameter_counts(model)["total"], None),
        "MoE, active per token": (moe_parameter_counts(model)["active"], forward_flops_per_token(model)["total"])}
pd.DataFrame(rows, index=["parameters", "forward FLOPs per token"]).T.astype("Int64")

# %% [markdown]
# ## The router on six tokens
#
# Logits `[tokens, experts]` → softmax → the `top_k = 2` best experts per token, their weights
# renormalised to sum to one. The same function runs inside every MoE layer.

# %%
torch.manual_seed(0)
logits = torch.randn(6, 4)
r = route(logits, top_k=2)
pd.DataFrame({"experts": r.indices.tolist(), "weights": r.weights.detach().round(decimals=3).tolist()},
             index=pd.Index(range(6), name="token"))

# %% [markdown]
# ## Train with ep = 2 and ep = 4 on the cluster, against the serial model
#
# The serial model (one process, every expert, the whole batch) trains 3 steps here; then 2 and 4
# engines train the same 3 steps with the experts split over them (ep = dp: each rank also takes a
# share of the batch, and the expert weights are reduced over their own data-parallel group). The
# losses must agree to fp32 rounding.

# %%
from mlmkit.cluster import Cluster
from mlmkit.distributed import ProcessGroups
from mlmkit.train.trainer import Trainer
base = TrainConfig(model=model, micro_batch_size=4, global_batch_size=16, lr=1e-2, min_lr=1e-3,
                   warmup_steps=2, max_steps=100)
serial = Trainer(base.replace(tracing=False), groups=ProcessGroups.single())
serial_losses = [serial.train_step()["loss"] for _ in range(3)]

runs = {}
cluster2 = Cluster(topology=base.replace(dp=2, ep=2).topology).start()
session = cluster2.session(base.replace(dp=2, ep=2))
runs[2] = [session.step()["loss"] for _ in range(3)]
session.close()
cluster2.shutdown()

config4 = base.replace(dp=4, ep=4)
cluster = Cluster(topology=config4.topology).start()
session = cluster.session(config4)
runs[4] = [session.step()["loss"] for _ in range(3)]
session.close()
for ep, losses in runs.items():
    assert max(abs(a - b) for a, b in zip(losses, serial_losses)) <= 1e-5 * serial_losses[0], ep
pd.DataFrame({"serial": serial_losses, **{f"ep={ep}": v for ep, v in runs.items()}},
             index=pd.Index(range(3), name="step"))

# %% [markdown]
# ## Where the tokens go, before and after training
#
# With ep = 4 (experts 0..3, one per rank) and **no balance loss**: the first step, then the same
# model after 60 steps. Left: the assignments each rank's tokens made to each expert, per layer;
# right: all of them per expert, against the even load (dashed).

# %%
def train(config, steps, *, trace_last=5):
    session = cluster.session(config)
    first = session.step()
    moe_first = session.traces()["moe"]
    session.train(steps - trace_last - 1, progress=False)
    session.traces(clear=True)
    session.train(trace_last, progress=False)
    traces, metrics = session.traces(), session.metrics()
    session.close()
    return moe_first, traces, metrics

def imbalance(moe):
    load = expert_load(moe).groupby(level="layer").sum()
    return load.max(axis=1) / load.mean(axis=1)

free = dataclasses.replace(model, moe_aux_loss_coeff=0.0)
moe_first, free_traces, free_metrics = train(config4.replace(model=free), 66)
expert_load_figure(moe_first, title="step 0, no balance loss")

# %%
expert_load_figure(free_traces["moe"], title="after 60 steps, no balance loss")

# %% [markdown]
# ## The load-balancing loss
#
# Switch/GShard's loss `E · Σ_e f_e · P_e` (fraction of tokens routed to expert `e` times its mean
# router probability) is smallest when both are even. Here it is weighted by 0.1 and added in the
# router's backward. Same data, same start:

# %%
balanced = dataclasses.replace(model, moe_aux_loss_coeff=0.1)
_, bal_traces, bal_metrics = train(config4.replace(model=balanced), 66)
expert_load_figure(bal_traces["moe"], title="after 60 steps, balance loss 0.1")

# %%
table = pd.DataFrame({"no balance loss": imbalance(free_traces["moe"]),
                      "balance loss 0.1": imbalance(bal_traces["moe"]),
                      "step 0": imbalance(moe_first)}).rename_axis("busiest expert / even load")
assert (table["balance loss 0.1"] < table["no balance loss"]).all()
table.round(2)

# %%
moe_training_figure(bal_metrics)

# %% [markdown]
# ## What the all-to-alls move
#
# Bytes each rank sent to each rank in the last 5 steps of the balanced run (dispatch and combine,
# forward and backward, and the token counts exchanged first). Uneven routing shows up as uneven
# cells. For a router **forced** to an even assignment (`moe_force_uniform=True`) the estimator's
# bytes on the `ep` axis are exact:

# %%
all_to_all_figure(bal_traces["comm"])

# %%
uniform = config4.replace(model=dataclasses.replace(model, moe_force_uniform=True))
session = cluster.session(uniform)
session.step()
session.traces(clear=True)
session.step()
measured = session.traces()["comm"]
session.close()
table = compare_comm(measured, estimate_train_comm(uniform))
assert (table.measured == table.estimated).all()
table[table.kind == "ep"]

# %% [markdown]
# ## A capacity factor: fixed-size experts, dropped tokens
#
# With a capacity factor `c`, each expert takes at most `c · tokens · top_k / E` assignments from
# each rank's tokens; what is over is dropped (the lowest router probabilities first). The unbalanced
# model of above drops many; a larger factor or the balance loss drop fewer. A step makes
# `16 sequences × 32 tokens × top_k 2 × 2 layers = 2048` assignments:

# %%
ASSIGNMENTS = base.global_batch_size * model.seq_len * model.top_k * model.layers
rows = {}
for name, m in (("no balance loss", free), ("balance loss 0.1", balanced)):
    for factor in (1.0, 1.5):
        capped = config4.replace(model=dataclasses.replace(m, moe_capacity_factor=factor))
        session = cluster.session(capped)
        metrics = session.train(30, progress=False)
        session.close()
        rows[(name, factor)] = {"dropped %, first 5 steps": 100 * metrics.dropped.iloc[:5].sum() / (5 * ASSIGNMENTS),
                                "dropped %, last 5 steps": 100 * metrics.dropped.iloc[-5:].sum() / (5 * ASSIGNMENTS),
                                "loss after 30 steps": float(metrics.loss.iloc[-1])}
drops = pd.DataFrame(rows).T.rename_axis(["model", "capacity factor"])
last = drops["dropped %, last 5 steps"]
assert last[("no balance loss", 1.5)] < last[("no balance loss", 1.0)] and last[("balance loss 0.1", 1.5)] < last[("no balance loss", 1.5)]
drops.round(2)

# %%
cluster.shutdown();

# %% [markdown]
# ## What this showed
# * An MoE layer decouples parameters from work: 4 experts hold four times the MLP weights of the
#   dense model, and top-2 does twice its MLP work per token, however many experts there are.
# * Expert parallelism splits the experts over ranks and moves tokens with two all-to-alls each way;
#   the result equals the serial model's.
# * Left alone, the router drifts to favourite experts; the balance loss keeps the load near even,
#   and a capacity factor turns imbalance into dropped tokens.
#
# ## Exercises (predict, then check)
# 1. With `E = 8` experts, `top_k = 2` and a capacity factor 1.25, how many assignments can each
#    expert take from a rank holding 64 tokens?
# 2. With ep = 4 and perfectly even routing, what fraction of a rank's assignments leave the rank?
# 3. From 4 to 8 experts (same `top_k`), how many forward FLOPs per token does this model gain?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
from mlmkit.moe import capacity
SHOW_ANSWERS = False
answers = {1: capacity(64, top_k=2, experts=8, factor=1.25), 2: 3 / 4,
           3: forward_flops_per_token(dataclasses.replace(model, experts=8))["total"] - forward_flops_per_token(model)["total"]}
assert answers == {1: 20, 2: 0.75, 3: 2 * 2 * 32 * 4}     # only the router grows: 2 FLOPs x layers x hidden x 4 experts
if SHOW_ANSWERS:
    print(answers)
