# %% [markdown]
# # 06 · Context parallelism: a long sequence split over ranks, ring attention
#
# Tensor and sequence parallelism split the *model*; with long sequences the **activations** of one
# sequence no longer fit one device. **Context parallelism** (cp) splits each *sequence* over `cp`
# ranks: every rank embeds, normalises and runs the MLP on its own tokens only (no communication),
# and attention, the one place where tokens meet, becomes **ring attention**: the keys and values go
# round the ring of cp ranks, one hop per step, while each rank attends with its queries to the block
# it holds; partial results merge with an online softmax (log-sum-exp). The backward sends the keys'
# and values' gradients round the same ring. Megatron-LM, TransformerEngine and torchtitan do this;
# Llama 3 trained with cp = 16.
#
# Causal attention makes it uneven: the last tokens attend to everything, the first to almost nothing.
# Cut into `cp` contiguous pieces (**naive**), the last rank works, the first waits. Megatron-LM cuts
# the sequence into `2·cp` chunks and gives rank *i* chunks *i* and *2cp−1−i* (**balanced**).

# %%
import pandas as pd
import plotly.io as pio
pio.renderers.default = "notebook"
from mlmkit.context_parallel import attention_work, held_positions, simulate_ring
from mlmkit.viz import cp_split_figure, cp_work_frame
cp_split_figure(16, 4, "balanced")

# %% [markdown]
# Top: who holds which token (colour = cp rank). Below, one panel per ring step: each (query, key)
# pair of the causal matrix coloured by the rank that computes it at that step. With the balanced
# split every rank computes the same number of pairs; with the naive split:

# %%
cp_split_figure(16, 4, "naive")

# %%
pd.DataFrame({split: attention_work(16, 4, split) for split in ("balanced", "naive")},
             index=pd.Index(range(4), name="cp rank")).rename_axis(columns="(query, key) pairs")

# %% [markdown]
# What rank 1 holds and computes at each ring step (positions of queries and of the keys it holds):

# %%
cp_work_frame(16, 4, "balanced").query("rank == 1")

# %% [markdown]
# ## A sequence too long for one rank
#
# A Llama-style model (RMSNorm, SwiGLU, rotary positions, grouped-query attention) on sequences of
# 512 tokens, and a budget of **6 MiB of activations per rank**. The estimator (exact for mlmkit's
# layers) says cp = 1 does not fit; cp = 2 and cp = 4 do:

# %%
from mlmkit.estimate import estimate_train_comm, estimate_train_memory
from mlmkit.model.config import llama_config
from mlmkit.train import TrainConfig
BUDGET = 6 * 2**20
model = llama_config(seq_len=512, hidden=64, heads=4, kv_heads=2, layers=2, ffn_hidden=176)
base = TrainConfig(model=model, micro_batch_size=2, global_batch_size=4, lr=3e-3, warmup_steps=1, max_steps=20)
plan = pd.DataFrame({cp: {"activations (MiB)": estimate_train_memory(base.replace(cp=cp)).activations.max() / 2**20}
                     for cp in (1, 2, 4)}).T.rename_axis("cp")
plan["fits 6 MiB"] = plan["activations (MiB)"] * 2**20 <= BUDGET
assert list(plan["fits 6 MiB"]) == [False, True, True]
plan.round(2)

# %% [markdown]
# ## Train it with cp = 2 and cp = 4 on the cluster, against the serial model
#
# The serial model (one process, the whole sequence) trains 3 steps here in the notebook; then 2
# and 4 engines train the same 3 steps with the sequence split. Same data, same initial weights:
# the losses must agree to fp32 rounding.

# %%
from mlmkit.cluster import Cluster
from mlmkit.distributed import ProcessGroups
from mlmkit.train.trainer import Trainer
serial = Trainer(base.replace(tracing=False), groups=ProcessGroups.single())
serial_losses = [serial.train_step()["loss"] for _ in range(3)]

runs = {}
for cp in (2, 4):
    config = base.replace(cp=cp)
    with Cluster(topology=config.topology) as cluster:
        session = cluster.session(config)
        losses = [session.step()["loss"] for _ in range(2)]
        session.traces(clear=True)
        losses.append(session.step()["loss"])            # the traced step
        runs[cp] = dict(config=config, losses=losses, traces=session.traces())
        session.close()
pd.DataFrame({"serial": serial_losses, **{f"cp={cp}": r["losses"] for cp, r in runs.items()}},
             index=pd.Index(range(3), name="step"))

# %%
for cp, r in runs.items():
    assert max(abs(a - b) for a, b in zip(r["losses"], serial_losses)) <= 1e-5 * serial_losses[0], cp
print("cp = 2 and cp = 4 reproduce the serial losses")

# %% [markdown]
# ## Memory per rank: measured against the estimate, about 1/cp of cp = 1
#
# The cp = 1 figure is the estimator's (it matches measurements exactly, see notebook 04); cp = 2 and
# cp = 4 are measured on the engines.

# %%
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.viz import cp_memory_figure
rows = [{"cp": 1, "measured": plan.loc[1, "activations (MiB)"] * 2**20,
         "estimated": plan.loc[1, "activations (MiB)"] * 2**20}]
for cp, r in runs.items():
    table = compare_memory(r["traces"]["memory"], estimate_train_memory(r["config"]))
    acts = table[table.kind == "activations"]
    assert ((acts.ratio - 1).abs() <= 0.10).all()
    rows.append({"cp": cp, "measured": acts.measured.max(), "estimated": acts.estimated.max()})
memory = pd.DataFrame(rows)
cp_memory_figure(memory)

# %% [markdown]
# ## Bytes per rank: the ring's messages, exactly as estimated
#
# Per layer and microbatch each rank sends `cp − 1` key/value blocks forward, and in backward
# `cp − 1` blocks again plus `cp` blocks of their gradients (fp32). Everything else on the dp axis is
# the gradient reduction, now over the dp × cp ranks that hold the same weights.

# %%
from mlmkit.viz import comm_by_axis_figure
r = runs[4]
est = estimate_train_comm(r["config"])
table = compare_comm(r["traces"]["comm"], est)
assert (table.measured == table.estimated).all()
comm_by_axis_figure(r["traces"]["comm"], estimate=est)

# %% [markdown]
# ## Balanced against naive on the timeline
#
# The same cp = 4 run with the naive split. Each bar is one ring step's attention compute; gaps are
# waiting for the next block (and, on a laptop with fewer cores than ranks, for a core).

# %%
from mlmkit.viz import ring_timeline_figure
naive_config = base.replace(cp=4, cp_split="naive")
with Cluster(topology=naive_config.topology) as cluster:
    session = cluster.session(naive_config)
    session.step()
    session.traces(clear=True)
    session.step()
    naive = session.traces()
    session.close()
balanced = runs[4]["traces"]
ring_timeline_figure(naive["ring"][naive["ring"].site == "layers.0.attn.ring"], naive["comm"],
                     title="naive split, cp = 4: layer 0's ring steps")

# %%
ring_timeline_figure(balanced["ring"][balanced["ring"].site == "layers.0.attn.ring"], balanced["comm"],
                     title="balanced split, cp = 4: layer 0's ring steps")

# %%
work = pd.DataFrame({name: t["ring"][t["ring"].phase == "forward"].groupby("rank").pairs.sum()
                     for name, t in (("balanced", balanced), ("naive", naive))})
busy = pd.DataFrame({name: t["ring"].assign(d=t["ring"].end - t["ring"].start).groupby("rank").d.sum() * 1e3
                     for name, t in (("balanced", balanced), ("naive", naive))})
assert work.balanced.nunique() == 1 and work.naive.is_monotonic_increasing and work.naive.iloc[-1] > 2 * work.naive.iloc[0]
pd.concat({"pairs computed (forward)": work, "attention compute (ms)": busy.round(1)}, axis=1)

# %% [markdown]
# The simulator shows the same without the noise of shared cores: a ring of 4 layers where a pair
# costs 1 µs and a block takes 20 µs to arrive. With the naive split rank 0 is idle most of the
# time; with the balanced split nobody waits.

# %%
sim = {split: pd.DataFrame(simulate_ring(512, 4, split, layers=4, pair_time=1e-6, message_time=2e-5))
       for split in ("balanced", "naive")}
idle = pd.DataFrame({split: 1 - (df.end - df.start).groupby(df["rank"]).sum() / df.end.max() for split, df in sim.items()})
assert idle.balanced.max() < 0.01 and idle.naive.iloc[0] > 0.5
(idle * 100).round(1).rename_axis("rank").rename(columns=lambda c: f"{c}: idle %")

# %% [markdown]
# ## What this showed
# * Context parallelism splits every sequence over `cp` ranks; only attention communicates, as a
#   ring of key/value blocks overlapped with computation, and the result equals the serial model's.
# * Activation memory per rank falls to about `1/cp`, which is what lets long sequences fit.
# * Causal attention needs the balanced split (chunks `i` and `2cp−1−i`), or the ring runs at the
#   speed of its busiest rank.
#
# ## Exercises (predict, then check)
# 1. How many key/value messages does one rank send per layer and microbatch in **forward** at cp = 8?
# 2. With the balanced split, s = 64 and cp = 4, how many (query, key) pairs does each rank compute?
# 3. Does cp reduce the **parameter** memory per rank? (Look at `estimate_train_memory(...).parameters`.)
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
SHOW_ANSWERS = False
answers = {1: 8 - 1, 2: attention_work(64, 4)[0],
           3: bool(estimate_train_memory(base.replace(cp=2)).parameters.max() < estimate_train_memory(base).parameters.max())}
assert answers == {1: 7, 2: 520, 3: False}      # 520 = 64 * 65 / 2 / 4: every rank the same share
if SHOW_ANSWERS:
    print(answers)
