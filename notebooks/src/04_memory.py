# %% [markdown]
# # 04 · Memory: estimate against measurement
#
# mlmkit counts memory exactly on the CPU: parameters, gradients, optimizer state, and every
# activation autograd saves for backward (saved-tensor hooks). The estimator
# (`mlmkit.estimate`, pure Python) predicts the same per rank from the model, the layout and the
# schedule, following Korthikanti et al. 2022 (activations per layer `sbh(34 + 5as/h)` and its tensor-,
# sequence-parallel and recompute variants) adapted to what mlmkit's layers store.

# %%
import pandas as pd
from mlmkit.cluster import Cluster
from mlmkit.estimate import estimate_train_memory
from mlmkit.estimate.compare import compare_memory
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig
# attention="eager" keeps the s x s attention scores, as in the paper (the default, SDPA, does not: below)
base = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4, attention="eager"),
                   tp=2, pp=2, micro_batch_size=4, global_batch_size=32)
cluster = Cluster(topology=base.topology).start()

# %%
def measure(config):
    session = cluster.session(config)
    session.step()
    session.traces(clear=True)
    session.step()
    est = estimate_train_memory(config)          # every option taken from the config
    memory = session.traces()["memory"]
    session.close()
    return memory, est

variants = {
    "1F1B": base,
    "GPipe": base.replace(schedule="gpipe"),
    "1F1B + full recompute": base.replace(recompute="full"),
    "1F1B + selective recompute": base.replace(recompute="selective"),
    "1F1B + sequence parallel": base.replace(sequence_parallel=True),
    "1F1B, SDPA (flash)": base.replace(model={"attention": "sdpa"}),
    "1F1B, bf16": base.replace(precision="bf16"),
}
rows = []
for label, cfg in variants.items():
    memory, est = measure(cfg)
    table = compare_memory(memory, est)
    acts = table[table.kind == "activations"].set_index("rank")
    assert ((acts.ratio - 1).abs() < 0.10).all(), (label, acts)
    for rank, row in acts.iterrows():
        rows.append({"variant": label, "rank": rank, "measured MiB": row.measured / 2**20,
                     "estimated MiB": row.estimated / 2**20, "ratio": row.ratio})
peaks = pd.DataFrame(rows)
peaks.pivot(index="variant", columns="rank", values="measured MiB").round(3)

# %%
from mlmkit.viz import activation_peaks_figure
activation_peaks_figure(peaks, title="Peak activation memory per rank: measured (bars) and estimated (marks); "
                                     "GPipe holds every microbatch")

# %%
memory, est = measure(base)
from mlmkit.viz import memory_figure
memory_figure(memory, estimate=est)

# %% [markdown]
# **Selective recomputation** (Korthikanti et al. 2022, section 5) reruns only the attention core
# (QK^T, softmax, dropout, attention over V) in backward: it drops the `5as/h` part, the `s x s`
# scores, at the cost of a few cheap FLOPs. **SDPA** (flash kernels) never stores those scores in the
# first place, so with it selective recomputation has almost nothing left to save. **bf16** halves
# every activation (the fp32 softmax and statistics excepted) and, per parameter, keeps 2 bytes of
# weight + 4 of fp32 gradient + 12 of fp32 master weight and Adam moments = 18 bytes, against 16 in
# fp32: mixed precision saves activation memory, not model-state memory.

# %%
state = []
for label in ("1F1B", "1F1B, bf16"):
    memory, est = measure(variants[label])
    table = compare_memory(memory, est)
    assert (table[table.kind != "activations"].measured == table[table.kind != "activations"].estimated).all()
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        row = table[(table["rank"] == 0) & (table.kind == kind)].iloc[0]
        state.append({"precision": label, "kind": kind, "measured KiB": row.measured / 1024,
                      "estimated KiB": row.estimated / 1024})
pd.DataFrame(state).pivot(index="kind", columns="precision", values=["measured KiB", "estimated KiB"]).round(1)

# %% [markdown]
# ## The published formulas, for GPT-3 175B (s=2048, h=12288, a=96, b=1, t=8)

# %%
from mlmkit.estimate import activation_bytes_per_layer
kw = dict(s=2048, b=1, h=12288, a=96, precision="bf16", implementation="megatron")
pd.Series({
    "no parallelism": activation_bytes_per_layer(**kw),
    "tensor parallel (t=8)": activation_bytes_per_layer(t=8, **kw),
    "tensor + sequence parallel": activation_bytes_per_layer(t=8, sequence_parallel=True, **kw),
    "+ selective recompute (34 sbh/t)": activation_bytes_per_layer(t=8, sequence_parallel=True, recompute="selective", **kw),
    "+ full recompute": activation_bytes_per_layer(t=8, sequence_parallel=True, recompute="full", **kw),
}).div(2**20).round(1).rename("MiB per layer")

# %%
cluster.shutdown()

# %% [markdown]
# ## What this showed
# * Memory per rank is model state (parameters, gradients, optimizer) plus activations, and the
#   estimator predicts both from the configuration.
# * Recomputation trades compute for activation memory; sequence parallelism splits the activations
#   that tensor parallelism leaves replicated; bf16 halves activations and parameters.
#
# ## Exercises (predict, then check)
# 1. Korthikanti et al.'s activations per layer: by what factor does full recomputation shrink them
#    for s = 2048, b = 1, h = 12288, a = 96, t = 8 with sequence parallelism?
# 2. Model-state bytes per parameter: fp32 AdamW against bf16 mixed precision?
# 3. Does sequence parallelism change the parameter memory?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
from mlmkit.estimate import activation_bytes_per_layer, bytes_per_parameter
SHOW_ANSWERS = False
args = dict(s=2048, b=1, h=12288, a=96, t=8, sequence_parallel=True, precision="bf16", implementation="megatron")
ratio = activation_bytes_per_layer(**args) / activation_bytes_per_layer(**args, recompute="full")
answers = {1: round(ratio, 1), 2: (bytes_per_parameter(precision="fp32"), bytes_per_parameter(precision="bf16")),
           3: False}
assert answers[2] == (16, 18) and answers[1] > 10
if SHOW_ANSWERS:
    print(answers)
