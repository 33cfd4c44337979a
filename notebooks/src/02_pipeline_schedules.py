# %% [markdown]
# # 02 · Pipeline schedules and their bubbles
#
# **Pipeline parallelism** cuts the layer stack into `p` *stages*, one per rank. A batch is cut into
# `m` *microbatches*; each flows forward through the stages, then its gradient flows backward.
#
# A stage cannot start a microbatch before the previous stage hands it over, so at the start and
# the end of every step some stages **wait**. That idle time is the **pipeline bubble**. With
# forward cost `F` and backward cost `B` per stage and microbatch:
#
# * **GPipe** runs all forwards, then all backwards. Each rank is busy `m(F+B)` out of a step of
#   `(m + p - 1)(F + B)`: the bubble is **(p-1)/(m+p-1)** of the step. More microbatches, smaller bubble,
#   but every rank holds the activations of all `m` microbatches.
# * **1F1B** (PipeDream-Flush) alternates one forward and one backward once the pipeline is full: same
#   bubble, but rank `r` never holds more than `p - r` microbatches.
# * **Interleaved 1F1B** gives each rank `v` smaller *chunks* of layers: the bubble shrinks `v`-fold,
#   **(p-1)/(v·m)** of the ideal time, for more messages.
# * **ZB-H1** (zero bubble) splits backward into B (input gradient, which the previous stage waits
#   for) and W (weight gradient, which nobody waits for) and fills bubbles with W.
#
# In mlmkit a schedule is **data**: a list of actions per rank. The same object is validated,
# simulated, drawn and executed.

# %%
from mlmkit.pipeline import make_schedule, simulate, validate
s = make_schedule("1f1b", stages=4, microbatches=8)
print(s)                     # compute actions per rank; sends and receives are in s.actions too
s.to_frame().head(8)

# %% [markdown]
# ## Simulate all four (free communication)
#
# Per rank and microbatch: forward 1, backward 2 (1 for the input gradients, 1 for the weight
# gradients, which zero-bubble schedules run separately as I and W). With interleaving each of the
# `v` chunks holds `1/v` of the rank's layers, so it costs `1/v` of that: the same work.

# %%
import pandas as pd
rows = []
for name, chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]:
    res = simulate(make_schedule(name, stages=4, microbatches=8, chunks=chunks),
                   {"forward": 1.0 / chunks, "backward": 1.0 / chunks, "weight": 1.0 / chunks})
    rows.append({"schedule": name, "step_time": res.step_time, "bubble_of_step": res.bubble_fraction,
                 "bubble_of_ideal": res.bubble_ratio, "peak_inflight": list(res.peak_inflight.values())})
table = pd.DataFrame(rows).set_index("schedule")
table

# %%
p, m = 4, 8
assert abs(table.loc["gpipe", "bubble_of_step"] - (p - 1) / (m + p - 1)) < 1e-9
assert abs(table.loc["interleaved-1f1b", "bubble_of_ideal"] - (p - 1) / (2 * m)) < 1e-9
idle = lambda n: table.loc[n, "step_time"] * table.loc[n, "bubble_of_step"]
assert abs(idle("zb-h1") / idle("1f1b") - 1 / 3) < 1e-9      # a third of 1F1B's bubble
assert table.loc["interleaved-1f1b", "step_time"] < table.loc["1f1b", "step_time"] == (m + p - 1) * 3

# %%
from mlmkit.viz import timeline_figure
timeline_figure(simulate(make_schedule("1f1b", stages=4, microbatches=8), {"forward": 1, "backward": 2}).timeline,
                title="1F1B, p=4, m=8 (grey = bubble)")

# %% [markdown]
# ## The explorer: try your own p, m, v and costs

# %%
from mlmkit.viz import schedule_explorer
explorer = schedule_explorer(schedule="interleaved-1f1b", stages=4, microbatches=8, chunks=2)
explorer

# %%
explorer.microbatches.value = 16            # widgets can be driven from code too
explorer.result

# %% [markdown]
# ## Schedules that must not run are caught before they run
# A hand-written schedule is checked like a generated one: matching sends and receives, forward
# before backward, and a dry run of the send/receive graph that finds deadlocks.

# %%
from mlmkit.pipeline import ScheduleError, schedule_from_table
broken = schedule_from_table([
    {"rank": 0, "kind": "F", "microbatch": 0}, {"rank": 0, "kind": "RECV_GRAD", "microbatch": 0, "peer": 1},
    {"rank": 0, "kind": "SEND_ACT", "microbatch": 0, "peer": 1}, {"rank": 0, "kind": "B", "microbatch": 0},
    {"rank": 1, "kind": "RECV_ACT", "microbatch": 0, "peer": 0}, {"rank": 1, "kind": "F", "microbatch": 0},
    {"rank": 1, "kind": "B", "microbatch": 0}, {"rank": 1, "kind": "SEND_GRAD", "microbatch": 0, "peer": 0},
])
try:
    validate(broken)
    raise AssertionError("validate() accepted a deadlock")
except ScheduleError as err:
    print(err)
    assert "deadlock" in str(err)

# %% [markdown]
# ## Now for real: measured over simulated
# Two ranks (pp = 2) run 1F1B on the tiny GPT. We then calibrate the simulator with the measured
# forward and backward times and lay the prediction over the measurement.

# %%
from mlmkit.cluster import Cluster
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig
config = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=4),
                     pp=2, schedule="1f1b", micro_batch_size=4, global_batch_size=16)
cluster = Cluster(topology=config.topology).start()
session = cluster.session(config)
session.step()                               # warm-up

# %% [markdown]
# Step through the first actions one by one: each call runs every rank whose next action can complete.

# %%
for _ in range(4):
    print(session.step_action())
session.state()[["pp", "position", "actions", "next_action", "held", "activation_bytes"]]

# %% [markdown]
# The same with buttons: `SessionControls` steps an action, a microbatch or the whole step, or
# resets it, and shows each rank's state and the step in logical time (done in colour, to do in
# grey; wall-clock time would count your thinking between clicks as bubble).

# %%
from mlmkit.viz import SessionControls
controls = SessionControls(session)
controls.action_button.click()
assert controls.error is None and controls.timeline.done.any()
controls

# %%
session.step()                               # finish this step
session.traces(clear=True)
session.step()                               # the measured step
measured = session.traces()["events"]
from mlmkit.pipeline import Costs
stats = measured.assign(d=measured.end - measured.start).groupby(["rank", "action"]).d.mean().unstack()
costs = Costs(forward=list(stats["F"]), backward=list(stats["B"]))
sim = simulate(make_schedule("1f1b", stages=2, microbatches=config.microbatches), costs)
from mlmkit.viz import timeline_comparison
timeline_comparison(sim.timeline, measured, title="1F1B on 2 ranks: simulated (calibrated) vs measured")

# %%
span = measured.end.max() - measured.start.min()
print(f"measured step {span*1e3:.1f} ms, simulated {sim.step_time*1e3:.1f} ms")

# %% [markdown]
# ## Zero bubble for real: 1F1B, ZB-H1 and ZB-V on the same ranks
# Zero-bubble schedules split a backward into **I** (the input gradient, which the previous stage
# waits for) and **W** (the weight-gradient GEMMs, which nobody waits for) and use W to fill bubbles.
# mlmkit's linear layers really defer their weight GEMMs during I, so **I + W costs one backward**
# (B). ZB-V also places 2 chunks per rank in a V (rank 0 holds the first and the last stage). Each
# schedule is measured, calibrated from its own trace, and simulated:

# %%
import pandas as pd
from mlmkit.pipeline.simulate import calibrate
rows, timelines = [], {}
for name, chunks in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)):
    cfg = config.replace(schedule=name, chunks=chunks)
    s = cluster.session(cfg)
    s.step()
    s.traces(clear=True)
    s.step()
    ev = s.traces()["events"]
    s.close()
    sched = make_schedule(name, stages=2, microbatches=cfg.microbatches, chunks=chunks)
    sim = simulate(sched, calibrate(ev, sched))
    per_action = ev.assign(d=(ev.end - ev.start) * 1e3).groupby("action").d.median()
    rows.append({"schedule": name, "measured step (ms)": (ev.end.max() - ev.start.min()) * 1e3,
                 "simulated step (ms)": sim.step_time * 1e3, "simulated bubble": sim.bubble_fraction,
                 **{f"median {k} (ms)": v for k, v in per_action.items()}})
    timelines[name] = (sim.timeline, ev)
table = pd.DataFrame(rows).set_index("schedule")
# Times on a shared laptop are noisy: what is certain is the structure (a split backward runs as I and W).
assert {"median I (ms)", "median W (ms)"} <= set(table.columns) and table.loc["1f1b", "median B (ms)"] > 0
table.round(2)

# %%
timeline_comparison(*timelines["zb-v"], title="ZB-V on 2 ranks: simulated (calibrated) vs measured")

# %% [markdown]
# On a laptop whose ranks each have a core, zero bubble shortens the step when W fills real idle
# time. With more ranks than cores the idle time is not idle (another rank computes), so it gains
# little: `simulate(..., cores=2)` models exactly that (see `benchmarks/RESULTS.md`).

# %% [markdown]
# ## A schedule of your own, trained for real (and handed to PyTorch)
# A schedule is a table of actions, so you can write one the generators do not make. Here: every
# rank runs 1F1B with its backwards split into I and W, and leaves **all** its W's to the end of the
# step (the weight gradients wait; the previous stage gets its input gradients early). Exported as
# PyTorch's pipeline CSV (`to_torch_csv`, the format `torch.distributed.pipelining` loads), the same
# file is a `TrainConfig`'s `schedule`: the session checks it (ranks, chunks, microbatches, that it
# can run) and trains with it, with every other option of the config.

# %%
import os, tempfile
from mlmkit.pipeline import to_torch_csv
m = config.microbatches
def late_w(rank):
    order = 1 - rank                   # forwards before the first backward: 2 on rank 0, 1 on rank 1
    acts = [("F", k) for k in range(order + 1)]
    for k in range(m):
        acts.append(("I", k))
        if k + order + 1 < m:
            acts.append(("F", k + order + 1))
    return acts + [("W", k) for k in range(m)]
mine = schedule_from_table([{"rank": r, "kind": kind, "microbatch": k} for r in range(2) for kind, k in late_w(r)],
                           name="1f1b-late-w", add_communication=True)
validate(mine)
path = to_torch_csv(mine, os.path.join(tempfile.mkdtemp(), "late_w.csv"))
print(open(path).read())

# %%
own = cluster.session(config.replace(schedule=path))
plain = cluster.session(config)              # 1F1B from step 0, for the same batch
loss_own, loss_plain = own.step()["loss"], plain.step()["loss"]
print(f"loss with the file's schedule {loss_own:.6f}, with 1F1B {loss_plain:.6f}")
assert abs(loss_own - loss_plain) < 1e-5 and own.schedule.split_backward
own.close(); plain.close()

# %% [markdown]
# The same file runs in PyTorch's runtime (`_PipelineScheduleRuntime._load_csv(path)`), and
# `python -m mlmkit.train --schedule late_w.csv --pp 2 ...` trains with it as a batch job.

# %%
cluster.shutdown()

# %% [markdown]
# ## What this showed
# * A schedule is data: per rank, the order of forwards, backwards and messages; it is validated
#   (deadlocks, mis-paired messages) before anything runs.
# * The bubble of GPipe and 1F1B is `(p−1)/(m+p−1)` of the step; interleaving divides it by `v`;
#   zero-bubble schedules fill it with weight-gradient work.
# * Measured timelines follow the simulation once its costs are calibrated from a real step.
#
# ## Exercises (predict, then check)
# 1. GPipe with p = 4 and m = 4, equal costs: what share of the step is bubble?
# 2. Interleaved 1F1B with p = 4, m = 8, v = 2: the bubble as a share of the time without bubble?
# 3. Under 1F1B with p = 4, how many microbatches does rank 0 hold at most at once?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
SHOW_ANSWERS = False
gp = simulate(make_schedule("gpipe", stages=4, microbatches=4), {"forward": 1, "backward": 1})
il = simulate(make_schedule("interleaved-1f1b", stages=4, microbatches=8, chunks=2), {"forward": 0.5, "backward": 0.5})
one = simulate(make_schedule("1f1b", stages=4, microbatches=8), {"forward": 1, "backward": 1})
answers = {1: round(gp.bubble_fraction, 4), 2: round(il.bubble_ratio, 4), 3: one.peak_inflight[0]}
assert answers == {1: round(3 / 7, 4), 2: round(3 / 16, 4), 3: 4}
if SHOW_ANSWERS:
    print(answers)
