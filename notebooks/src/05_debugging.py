# %% [markdown]
# # 05 · Debugging: how mlmkit reports the usual mistakes
#
# Bad configurations fail before any process starts; a shard-shape mistake names the expected local
# and global shapes; a failing rank is reported with its rank and traceback and the cluster keeps
# working; a schedule that would deadlock is rejected before it runs.

# %% [markdown]
# ## 1. Configurations that cannot work fail immediately (no process started)

# %%
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig
model = GPTConfig(vocab_size=256, seq_len=32, hidden=66, heads=3, layers=4)
for bad in [dict(tp=4), dict(tp=1, dp=2, global_batch_size=10, micro_batch_size=4),
            dict(tp=1, pp=4, schedule="interleaved-1f1b", chunks=2)]:
    try:
        TrainConfig(model=model, **bad)
    except ValueError as err:
        print(f"{bad}: {err}")

# %% [markdown]
# ## 2. Shard-shape mistakes name the local and global shapes

# %%
from mlmkit import Topology
from mlmkit.cluster import Cluster, RankError
cluster = Cluster(topology=Topology(tp=2)).start()

def wrong_input(r):
    import torch
    from mlmkit.tensor_parallel import RowParallelLinear
    fc2 = RowParallelLinear(256, 64, tp=r.groups.tp, site="mlp.fc2")
    return fc2(torch.zeros(8, 2, 256))        # the full input instead of this rank's slice

try:
    cluster.run(wrong_input)
except RankError as err:
    print("rank", err.rank, "->", err.remote_traceback.strip().splitlines()[-1])

# %% [markdown]
# ## 3. A rank that fails while its peers wait in a collective

# %%
import time
def one_rank_fails(r):
    import time
    if r.rank == 1:
        time.sleep(0.2)
        raise RuntimeError("out of memory (simulated) on rank 1")
    x = torch.ones(1)
    r.groups.world.all_reduce(x)               # rank 0 waits here for rank 1
    return x.item()

t0 = time.monotonic()
try:
    cluster.run(one_rank_fails)
except RankError as err:
    print(f"reported after {time.monotonic() - t0:.2f} s: rank {err.rank}: {err.remote_traceback.splitlines()[-1]}")

# %%
def total(r):
    import torch
    x = torch.ones(1)
    r.groups.world.all_reduce(x)
    return x.item()
assert cluster.run(total) == {0: 2.0, 1: 2.0}     # the next cell works: groups were rebuilt

# %% [markdown]
# ## 4. Schedules that would deadlock or mis-pair messages are caught before they run

# %%
from mlmkit.pipeline import ScheduleError, make_schedule, schedule_from_table, validate
# Rows: (rank, kind, microbatch, chunk, peer). Rank 0 waits for the gradient before it sends the
# activation that rank 1 waits for: each waits for the other forever.
deadlock = schedule_from_table([
    (0, "F", 0, 0, None), (0, "RECV_GRAD", 0, 0, 1), (0, "SEND_ACT", 0, 0, 1), (0, "B", 0, 0, None),
    (1, "RECV_ACT", 0, 0, 0), (1, "F", 0, 0, None), (1, "B", 0, 0, None), (1, "SEND_GRAD", 0, 0, 0),
])
try:
    validate(deadlock)
    raise AssertionError("validate() accepted a deadlock")
except ScheduleError as err:
    print(err)
    assert "deadlock" in str(err)

# %%
from dataclasses import replace
s = make_schedule("1f1b", stages=2, microbatches=2)
# Rank 1 receives microbatch 1 first, but rank 0 sends microbatch 0 first (the pp=2 interleaving trap).
acts = list(s.actions[1])
i = next(k for k, a in enumerate(acts) if a.kind == "RECV_ACT" and a.microbatch == 1)
acts.insert(0, acts.pop(i))
try:
    validate(replace(s, actions=(s.actions[0], tuple(acts))))
except ScheduleError as err:
    print(err)

# %% [markdown]
# A schedule file (PyTorch's pipeline CSV, a `TrainConfig`'s `schedule`) is read and checked when the
# config is made: here a file written for 4 microbatches, given to a config that makes 8. The message
# names the fix; no process has started.

# %%
import os, tempfile
from mlmkit.pipeline import to_torch_csv
from mlmkit.train import demo_config
path = to_torch_csv(make_schedule("zb-h1", stages=2, microbatches=4), os.path.join(tempfile.mkdtemp(), "zbh1.csv"))
try:
    demo_config(tp=1, pp=2, global_batch_size=32, schedule=path)
    raise AssertionError("a file of 4 microbatches was taken for 8")
except ValueError as err:
    print(err)
    assert "set global_batch_size=16" in str(err)

# %% [markdown]
# Fewer microbatches than stages is allowed for 1F1B (as in Megatron-LM), with a note about the
# bubble; interleaving refuses it.

# %%
print(make_schedule("1f1b", stages=4, microbatches=2))
try:
    make_schedule("interleaved-1f1b", stages=4, microbatches=2, chunks=2)
except ScheduleError as err:
    print(err)

# %% [markdown]
# ## 5. NCCL pairs batched sends and receives by order, and waits for whole batches
#
# On GPUs, sends and receives are posted in batches (`batch_isend_irecv`) and NCCL ignores tags. The
# rule "each run of consecutive communication actions is one batch" deadlocks interleaved 1F1B as
# soon as there are more microbatches than stages; mlmkit plans batches that pair up instead, and
# its executor runs them (`batch_p2p=True`, the default with NCCL; on CPU it checks the same plan).

# %%
from mlmkit.pipeline.batching import check_batches, natural_batches, plan_batches
s = make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
try:
    check_batches(s, natural_batches(s))
except ScheduleError as err:
    print(str(err)[:300], "...")
plan = plan_batches(s)
print(f"the plan: {plan.rounds} lockstep rounds; rank 0 runs")
print("\n".join(plan.describe(0)[:8]))

# %%
cluster.shutdown()

# %% [markdown]
# ## What this showed
# * Wrong shapes and configs fail before anything starts, naming the value and the fix.
# * A failing rank is named with its traceback within seconds; its peers are released, and the next
#   call works.
# * Schedules that would deadlock or mis-pair their messages are refused before they run.
#
# ## Exercises (predict, then check)
# 1. Which exception does the driver raise when one rank's code raises?
# 2. Is a schedule whose backward comes before its forward accepted by `validate`?
# 3. A table row given as a tuple: how many entries may it have?
#
# Set `SHOW_ANSWERS = True` and run the next cell to check your predictions.

# %%
from mlmkit.cluster import RankError
SHOW_ANSWERS = False
try:
    validate(schedule_from_table([(0, "B", 0), (0, "F", 0)]))
    accepted = True
except ScheduleError:
    accepted = False
answers = {1: RankError.__name__, 2: accepted, 3: (3, 5)}
assert answers == {1: "RankError", 2: False, 3: (3, 5)}
if SHOW_ANSWERS:
    print(answers)
