# %% [markdown]
# # 00 · Quickstart: a tiny GPT trained with tensor × pipeline parallelism
#
# This notebook starts **4 ranks** (ipyparallel engines: one CPU process each, or one GPU each when
# CUDA exists), trains a tiny byte-level GPT with **tp = 2** (each weight matrix split in two) and
# **pp = 2** (the layer stack cut into two pipeline stages), and shows per rank:
#
# * the loss going down,
# * the pipeline **timeline** (forward/backward blocks, idle *bubbles*),
# * **memory** per rank (parameters, gradients, optimizer state, activations) next to the estimate,
# * **communication** per rank and axis next to the estimate.
#
# Runs on a laptop without a GPU in about a minute.

# %%
import json, os
from pathlib import Path

import plotly.io as pio
pio.renderers.default = "notebook"        # figures embed plotly.js: the exported HTML works offline

from mlmkit.cluster import Cluster
from mlmkit.train import demo_config
from mlmkit.estimate import estimate_comm, estimate_memory
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.viz import (comm_by_axis_figure, comm_heatmap, memory_figure, schedule_explorer,
                        timeline_figure, topology_figure)

config = demo_config(max_steps=30)        # 4-layer GPT, hidden 64, tp=2 x pp=2, 1F1B with 4 microbatches
config

# %% [markdown]
# The rank grid: Megatron-LM's order puts the two halves of each layer (tp) on neighbouring ranks.

# %%
topology_figure(config.topology.to_frame())

# %% [markdown]
# Start the cluster: 4 engines, `torch.distributed` (gloo on CPU) and the process groups of the grid.

# %%
cluster = Cluster(topology=config.topology).start()
cluster

# %% [markdown]
# ## Train
# A `Session` builds the same `Trainer` on every rank. `train(n)` runs `n` whole steps; the
# `02_pipeline_schedules` notebook steps through a single step action by action.

# %%
session = cluster.session(config)
metrics = session.train(29)
metrics.tail()

# %%
import plotly.express as px
px.line(metrics, x="step", y="loss", title="Training loss (byte-level GPT on the shipped corpus)")

# %%
assert metrics.loss.iloc[-3:].mean() < metrics.loss.iloc[:3].mean() - 0.5, "the model should learn"

# %% [markdown]
# ## One more step, traced
# Traces of the last step: every schedule action, every collective and message, and memory after
# every action, from all 4 ranks.

# %%
session.traces(clear=True)                 # drop the earlier steps' rows
last = session.step()
traces = session.traces()
timeline = traces["events"]
timeline_figure(timeline, title="Measured pipeline timeline of the last step", unit="s")

# %%
from mlmkit.viz import bubble_table
bubbles = bubble_table(timeline)
bubbles

# %% [markdown]
# Why more (or less) idle time than the textbook's 1F1B bubble, `(p - 1) / (m + p - 1)` = 1/5 = 20%
# here? That formula assumes every forward costs the same, every backward costs the same, and
# messages are free. To split the measured bubble, **replay** this step: run the same schedule again
# on paper, each action taking exactly the time it took here, each starting as soon as its input
# exists (messages free). The measured run had the same order and the same dependencies, plus real
# messages and waits for a core, so it can never be faster than the replay:
#
# * formula → replay: the action times themselves. The last stage also runs the head and the loss,
#   and 4 ranks share this machine's cores, so an action runs slower while other ranks compute.
# * replay → measured: messages through gloo (a fraction of a millisecond each) and a rank that
#   could run waiting for a core.
#
# On GPUs, one per rank, both gaps shrink and the measured share comes much closer to the formula.

# %%
import pandas as pd
from mlmkit.pipeline import make_schedule, replay, simulate
p, m = config.pp, config.microbatches
schedule = make_schedule(config.schedule, stages=p, microbatches=m)
pipeline = config.topology.groups("pp")[0]      # one pipeline's ranks, stage by stage (its tp peers do the same)
stages = timeline[timeline["rank"].isin(pipeline)].assign(rank=lambda t: t["rank"].map(pipeline.index))
formula = simulate(schedule, {"forward": 1, "backward": 2}).bubble_fraction
again = replay(timeline, schedule, ranks=pipeline)
span = stages.end.max() - stages.start.min()
measured_share = 1 - (stages.end - stages.start).sum() / (p * span)
assert abs(formula - (p - 1) / (m + p - 1)) < 1e-12       # equal costs: the formula, simulated
assert again.step_time <= span + 1e-6                       # the measured step can only be slower
pd.DataFrame({"bubble": [formula, again.bubble_fraction, measured_share],
              "step (ms)": [None, again.step_time * 1e3, span * 1e3]},
             index=["1F1B formula: equal costs, free messages", "replay: this step's action times, free messages",
                    "measured"]).style.format({"bubble": "{:.0%}", "step (ms)": "{:.1f}"}, na_rep="")

# %% [markdown]
# The replay above the measurement, block for block: where a measured block starts later than its
# replayed twin, the rank waited for a message or a core.

# %%
from mlmkit.viz import timeline_comparison
timeline_comparison(again.timeline, stages, title="This step replayed (simulated, free messages) vs measured, one rank per stage")

# %% [markdown]
# ## Step through a step
# The same session, one action at a time, with buttons: each click runs every rank whose next
# action can complete. The table shows each rank's position, its next action and the activations it
# holds (bytes); the timeline is in logical time (one slot per forward, two per backward): what is
# done in colour, what is still to do in grey. Think as long as you like between clicks: that is not
# a bubble. `microbatch` runs until the oldest unfinished microbatch has been through forward and
# backward on every rank (a zero-bubble schedule's W of it may come later: it fills a bubble), `step`
# to the end of the step and the weight update; `reset step` drops the step in progress (no weight
# update).

# %%
from mlmkit.viz import SessionControls
controls = SessionControls(session)
controls.action_button.click()            # what two clicks do, so that this page shows a step half-way
controls.microbatch_button.click()
assert controls.error is None and controls.timeline.done.any() and not controls.timeline.done.all()
controls

# %%
controls.step_button.click()              # finish the step
assert controls.error is None and not controls.timeline.done.any()   # between steps: the next plan

# %%
opts = dict(micro_batch_size=config.micro_batch_size, microbatches=config.microbatches, precision=config.precision)
mem_est = estimate_memory(config.model, config.topology, **opts)
memory_figure(traces["memory"], estimate=mem_est)

# %%
mem_table = compare_memory(traces["memory"], mem_est)
exact = mem_table[mem_table.kind != "activations"]
assert (exact.measured == exact.estimated).all()           # parameters, gradients, optimizer: exact
assert ((mem_table[mem_table.kind == "activations"].ratio - 1).abs() < 0.10).all()
mem_table.pivot(index="rank", columns="kind", values="ratio")

# %%
comm_est = estimate_comm(config.model, config.topology, **opts)
comm_table = compare_comm(traces["comm"], comm_est)
assert (comm_table.measured == comm_table.estimated).all()  # every byte accounted for
comm_by_axis_figure(traces["comm"], estimate=comm_est)

# %%
comm_heatmap(traces["comm"])

# %% [markdown]
# When each message and collective ran during the step, per rank and axis:

# %%
from mlmkit.viz import comm_timeline_figure
comm_timeline_figure(traces["comm"])

# %% [markdown]
# ## Explore schedules without a cluster
# Change the schedule, the number of stages `p`, microbatches `m`, chunks `v` and the costs of
# forward (F), backward (B) and weight-gradient (W) passes: the simulated timeline updates live.

# %%
schedule_explorer(schedule="1f1b", stages=2, microbatches=4)

# %%
summary = {
    "final_loss": float(metrics.loss.iloc[-1]),
    "last_step_loss": float(last["loss"]),
    "bubble_share": float(bubbles.idle.sum() / (bubbles.busy.sum() + bubbles.idle.sum())),
    "peak_memory_bytes_per_rank": {int(r): int(v) for r, v in
        (traces["memory"].assign(total=lambda m: m.parameters + m.gradients + m.optimizer + m.activations_peak)
         .groupby("rank").total.max()).items()},
}
Path("reports").mkdir(exist_ok=True)
Path("reports/quickstart_summary.json").write_text(json.dumps(summary, indent=2))
summary

# %% [markdown]
# Always stop the cluster: process groups first, then engines and controller.

# %%
cluster.shutdown()

# %% [markdown]
# ## What this showed
# * Four ranks trained one model: tp = 2 split each weight matrix, pp = 2 split the layer stack, and
#   the loss went down exactly as the serial model's would.
# * The timeline shows the pipeline's bubble: ranks idle while the pipeline fills and drains.
# * Memory and bytes per rank are measured on the engines and match the estimator.
#
# ## Exercises (predict, then check)
# 1. With pp = 2 and 4 microbatches under 1F1B (forward and backward of equal cost), what share of
#    the step is bubble?
# 2. With 8 microbatches instead, does that share go up or down?
# 3. Compared with one process holding the whole model, what fraction of the parameters does each of
#    the 4 ranks hold (roughly)?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
from mlmkit.pipeline import make_schedule, simulate
from mlmkit.train import demo_config
SHOW_ANSWERS = False
share = {m: simulate(make_schedule("1f1b", stages=2, microbatches=m), {"forward": 1, "backward": 1}).bubble_fraction
         for m in (4, 8)}
cfg = demo_config()
params = estimate_memory(cfg.model, cfg.topology, micro_batch_size=cfg.micro_batch_size,
                         microbatches=cfg.microbatches, precision=cfg.precision).parameters
serial = estimate_memory(cfg.model, cfg.topology.__class__(), micro_batch_size=cfg.micro_batch_size,
                         microbatches=cfg.microbatches, precision=cfg.precision).parameters[0]
answers = {1: round(share[4], 3), 2: "down" if share[8] < share[4] else "up", 3: round(float(params.mean() / serial), 2)}
assert answers[1] == round(1 / 5, 3) and answers[2] == "down" and 0.2 < answers[3] < 0.4
if SHOW_ANSWERS:
    print(answers)
