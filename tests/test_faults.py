"""Fault injection on a real 4-rank cluster (tp=2 x pp=2): a rank raising at every action index of a
step, an engine killed mid-step, a stuck rank, Ctrl-C during training. After each fault the right
rank is named within the bound, no healthy engine is replaced, and the next step's loss equals an
uninterrupted run's (a second session, stepped side by side on the same engines)."""

import glob
import itertools
import os
import random
import signal
import tempfile
import threading
import time

import pytest

from mlmkit import Topology
from mlmkit.cluster import Cluster, EngineDied, RankError, RankTimeout, StateLost
from mlmkit.cluster.cluster import alive
from mlmkit.model import GPTConfig
from mlmkit.pipeline import make_schedule
from mlmkit.pipeline.batching import plan_batches
from mlmkit.train import TrainConfig

# With dropout: a failed step's retry must draw the masks an uninterrupted run draws (the random
# streams are put back with the step; they once were not, and every retry trained another network).
CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4, dropout=0.1), tp=2, pp=2,
                  micro_batch_size=2, global_batch_size=8, max_steps=200)
TIMEOUT_S = 8.0           # the cluster's bound on every call (a step takes ~0.2 s)
REPORT_S = 5.0            # a raising or dying rank is reported within this


REF_STEPS = 60


class Harness:
    """A session with faults, and the losses of an uninterrupted run on the same engines."""

    def __init__(self, cluster, cfg=CFG, ref_steps=REF_STEPS):
        self.cluster = cluster
        reference = cluster.session(cfg, keep_last_step=False)
        self.ref_losses = list(reference.train(ref_steps, progress=False).loss)
        reference.close()
        self.session = cluster.session(cfg)

    def ref_loss(self, step: int) -> float:
        assert step < len(self.ref_losses), "raise ref_steps: the faulty session went further than the reference"
        return self.ref_losses[step]

    def engine_pids(self) -> list[int]:
        return [inf["pid"] for inf in self.cluster.info]

    def check_next_step(self) -> dict:
        row = self.session.step()
        want = self.ref_loss(row["step"])
        assert abs(row["loss"] - want) <= 1e-6 * abs(want), (row, want)
        assert row["step"] == len(self.session.history) - 1
        return row


@pytest.fixture(scope="module")
def harness():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "mlmkit-ipp-*")))
    cluster = Cluster(topology=Topology(tp=2, pp=2), timeout_s=TIMEOUT_S, grace_s=2.0)
    cluster.start()
    private = cluster.private_dir
    h = Harness(cluster)
    h.check_next_step()
    yield h
    pids = cluster.pids()
    cluster.shutdown()
    assert alive(pids) == []
    assert not os.path.exists(private)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "mlmkit-ipp-*"))) <= before


# ------------------------------------------------------------------------------ injections (engine side)
def _inject(state, sid, point, kind):
    """Make this rank fail once at ``point``: an action index of its schedule, "finalize",
    "optimizer" or "save" (the session saving the finished step). ``kind``: "raise", "kill"
    (SIGKILL itself), "abort" (a crash in C++: SIGABRT), "hang" (sleep far past the bound),
    "slow" (sleep 1.5 s, interruptible)."""
    import os
    import signal
    import time

    trainer = state.trainers[sid]
    ex = trainer.executor

    def fire():
        if kind == "raise":
            raise RuntimeError(f"injected failure at {point}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "abort":
            os.abort()
        time.sleep(600 if kind == "hang" else 1.5)

    def once(obj, name, when=lambda: True):
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            if when():
                setattr(obj, name, orig)
                fire()
            return orig(*a, **k)

        setattr(obj, name, wrapped)

    if point == "save":                  # the finished step's save (the same call as the step)
        from mlmkit.train import checkpoint

        once(checkpoint, "save_checkpoint")
    elif point == "finalize":
        once(ex, "finalize")
    elif point == "optimizer":
        once(trainer.optimizer, "step")
    else:
        once(ex, "step_action", lambda: ex.index == point)


def _points(rank, cfg=CFG):
    """Every place a step of ``rank`` can fail: each value the executor's ``index`` (actions done)
    takes before a ``step_action`` (with ``batch_p2p`` a batch of sends and receives is one call that
    counts all its actions), then the three phases after the actions: the step's end, the optimizer
    and the save of the finished step (a failed save: the step is done again from the last one saved)."""
    pp = cfg.topology.coords(rank).pp
    schedule = make_schedule(cfg.schedule, stages=cfg.pp, microbatches=cfg.microbatches, chunks=cfg.chunks)
    if cfg.batch_p2p:
        sizes = [len(step.actions) for step in plan_batches(schedule).steps[pp]]
    else:
        sizes = [1] * len(schedule.actions[pp])
    return [0, *itertools.accumulate(sizes)][:-1] + ["finalize", "optimizer", "save"]


# One rank of each pipeline stage (a tp-rank-1 and a tp-rank-0), every action index of the step and
# the three phases after it: every place a step can fail; and random points of the other two ranks.
SWEEP = [(rank, point) for rank in (1, 2) for point in _points(rank)]
SWEEP += [(rank, random.Random(7 + k).choice(_points(rank))) for k, rank in enumerate((0, 3, 0, 3, 0, 3))]


def _raise_everywhere(harness, sweep):
    cluster, session = harness.cluster, harness.session
    pids, generation = harness.engine_pids(), cluster.generation
    slowest, replaced = 0.0, []
    for rank, point in sweep:
        cluster.run(_inject, session.id, point, "raise", ranks=[rank])
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            session.step()
        elapsed = time.monotonic() - t0
        slowest = max(slowest, elapsed)
        if "get new engines" in str(info.value).splitlines()[0]:     # peers not released: killed
            replaced.append(f"rank {rank} at {point}, {elapsed:.2f} s: {info.value}")
        assert type(info.value) is RankError and info.value.rank == rank, (rank, point, info.value)
        assert f"injected failure at {point}" in info.value.remote_traceback
        assert elapsed < REPORT_S, (rank, point, elapsed)
        harness.check_next_step()            # weights of the last finished step were intact
    # no engine replaced (were any: the failures after which peers were not released, when, and
    # where each of those peers was when it was killed)
    assert harness.engine_pids() == pids and cluster.generation == generation, "\n".join(replaced)
    return slowest


def test_rank_raising_at_every_action_index(harness):
    slowest = _raise_everywhere(harness, SWEEP)
    print(f"{len(SWEEP)} injected failures, slowest report {slowest:.2f} s")


# The batched path (part 10) with a V placement, on the same engines: a rank's previous and next
# stage are the same peer, and a failing rank leaves whole batches of sends and receives posted.
# Every step of a stage-1 rank's batch plan, and random points of the other three ranks.
V_BATCHED = CFG.replace(schedule="dualpipev", chunks=2, batch_p2p=True)
V_BATCHED_SWEEP = [(2, point) for point in _points(2, V_BATCHED)]
V_BATCHED_SWEEP += [(rank, random.Random(11 + k).choice(_points(rank, V_BATCHED))) for k, rank in enumerate((0, 1, 3))]


def test_batched_v_schedule_failing_at_every_step(harness):
    h = Harness(harness.cluster, V_BATCHED, ref_steps=len(V_BATCHED_SWEEP) + 2)
    try:
        h.check_next_step()
        _raise_everywhere(h, V_BATCHED_SWEEP)
    finally:
        h.session.close()
    harness.check_next_step()                # the module's own session still steps on the same engines


def _release_slowly(state, sid, seconds):
    """The next abort of this rank waits ``seconds`` before it abandons its step and drops its groups
    (a peer slow to be released: the ranks blocked on it wait that long too)."""
    import time

    trainer = state.trainers[sid]
    orig = trainer.abandon_step

    def slow(*a, **k):
        trainer.abandon_step = orig
        time.sleep(seconds)
        return orig(*a, **k)

    trainer.abandon_step = slow


def _raise_then_stall_everyone(state, sid, point, pids, stall_s):
    """Raise at ``point`` as :func:`_inject` does, and 0.3 s later stop every process of ``pids``
    (the driver first, then the peers) for ``stall_s``, as a stall of the whole virtual machine does;
    the driver is woken 0.1 s before the peers."""
    import subprocess

    driver, peers = pids[0], " ".join(str(p) for p in pids[1:])
    subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -STOP {driver} {peers}; sleep {stall_s}; kill -CONT {driver}; "
                                  f"sleep 0.1; kill -CONT {peers}"], start_new_session=True)
    _inject(state, sid, point, "raise")


def test_a_stall_of_the_whole_machine_replaces_no_healthy_engine(harness):
    # A virtual machine whose host runs others can stop for seconds: every process stops, the wall
    # clock goes on. The driver gave the peers of a failing rank grace_s (2 s) of wall clock to be
    # released, so a stall right after a failure used it up while they could not run, and healthy
    # engines were killed and replaced (seen once in a full run of the suite: the sweep above lost
    # an engine). The grace now counts the time the driver runs. Here rank 1 raises, its tp peer
    # (rank 0) takes 1 s to let go, and 0.3 s after the failure everything stops for 3 s.
    cluster, session = harness.cluster, harness.session
    pids, generation = harness.engine_pids(), cluster.generation
    stall_s = 3.0
    for point in (2, 5):
        cluster.run(_release_slowly, session.id, 1.0, ranks=[0])
        cluster.run(_raise_then_stall_everyone, session.id, point, [os.getpid(), pids[0], pids[2], pids[3]], stall_s,
                    ranks=[1])
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            session.step()
        elapsed = time.monotonic() - t0
        assert type(info.value) is RankError and info.value.rank == 1, info.value
        assert "get new engines" not in str(info.value), info.value
        assert stall_s < elapsed < stall_s + REPORT_S, elapsed       # the stall happened, then the report
        assert harness.engine_pids() == pids and cluster.generation == generation     # no engine replaced
        harness.check_next_step()


# Context parallel with experts: the cp, dp-cp, tp-cp and expert groups must be released by a failing
# rank (or its peers stay blocked and get replaced) and rebuilt by the recovery (or the next step uses
# a destroyed group).
CP_EP_CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2, experts=4,
                                        top_k=2, moe_ffn_hidden=32, dropout=0.0),
                        cp=2, dp=2, ep=2, micro_batch_size=2, global_batch_size=8, max_steps=200)
CP_EP_SWEEP = [(rank, point) for rank in (1, 2) for point in _points(rank, CP_EP_CFG)]


def _sweep_on_own_cluster(cfg, sweep, after=None):
    """A cluster of ``cfg``'s grid: raise at every point of ``sweep`` (see :func:`_raise_everywhere`),
    then return ``after(cluster)`` if given."""
    with Cluster(topology=cfg.topology, timeout_s=TIMEOUT_S, grace_s=2.0) as cluster:
        h = Harness(cluster, cfg, ref_steps=len(sweep) + 2)
        h.check_next_step()
        _raise_everywhere(h, sweep)
        return after(cluster) if after is not None else None


def test_cp_and_expert_groups_released_and_rebuilt_after_a_failure():
    def live_groups(cluster):
        return cluster.run(lambda r: sorted(g.axis for g in r.groups.all_groups() if g.size > 1))

    groups = _sweep_on_own_cluster(CP_EP_CFG, CP_EP_SWEEP, after=live_groups)
    assert set(groups[0]) >= {"cp", "dp", "ep", "expert-dp", "world"}, groups


def test_engine_killed_mid_step(harness):
    cluster, session = harness.cluster, harness.session
    pids = harness.engine_pids()
    cluster.run(_inject, session.id, 5, "kill", ranks=[2])
    t0 = time.monotonic()
    with pytest.raises(EngineDied) as info:
        session.step()
    assert time.monotonic() - t0 < REPORT_S
    assert info.value.rank == 2 and alive([pids[2]]) == []
    assert "crashed" not in str(info.value)    # killed: nothing to show
    harness.check_next_step()                # rank 2 replaced, the last finished step reloaded
    now = harness.engine_pids()
    assert now[2] != pids[2] and [now[r] for r in (0, 1, 3)] == [pids[r] for r in (0, 1, 3)]
    # Forked by the zygote that forked the engines before it (torch is not imported again).
    zygote = _parent(now[2])
    assert zygote in {_parent(now[r]) for r in (0, 1, 3)} and "mlmkit.cluster.zygote" in _cmdline(zygote)


def _parent(pid: int) -> int:
    import psutil

    return psutil.Process(pid).ppid()


def _cmdline(pid: int) -> str:
    import psutil

    return " ".join(psutil.Process(pid).cmdline())


def test_an_engine_is_replaced_after_its_zygote_died(harness):
    # The zygote that forks replacements was killed (by a user, the OOM killer): the engines it
    # forked run on, and the next replacement comes from a new zygote of the same cluster, which
    # the shutdown at the end of this module stops with everything else (the fixture checks).
    import psutil

    cluster = harness.cluster
    pids = harness.engine_pids()
    zygote = _parent(pids[1])
    assert "mlmkit.cluster.zygote" in _cmdline(zygote)
    os.kill(zygote, signal.SIGKILL)
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.5)
    harness.check_next_step()
    now = harness.engine_pids()
    assert now[1] != pids[1] and [now[r] for r in (0, 2, 3)] == [pids[r] for r in (0, 2, 3)]
    fresh = _parent(now[1])
    assert fresh != zygote and "mlmkit.cluster.zygote" in _cmdline(fresh) and fresh in cluster.pids()
    assert not psutil.pid_exists(zygote) or psutil.Process(zygote).status() == psutil.STATUS_ZOMBIE


def test_engine_crashing_in_cpp_is_reported_with_its_stack(harness):
    # An engine aborted by a library (std::terminate, a segfault) was reported as "died" and no
    # more: the user had no way to tell where. faulthandler writes the crash into the rank's stack
    # file and EngineDied shows the thread that ran the step. The replacement engine's file starts
    # empty: a later death of that rank is not reported with this crash.
    cluster, session = harness.cluster, harness.session
    cluster.run(_inject, session.id, 3, "abort", ranks=[1])
    with pytest.raises(EngineDied) as info:
        session.step()
    text = str(info.value)
    assert info.value.rank == 1 and "Fatal Python error: Aborted" in text, text
    assert "in fire" in text and "mlmkit/cluster/engine.py" in text and "Extension modules" not in text, text
    harness.check_next_step()                # rank 1 replaced
    # Killed while saving the finished step (the step's own call): the step is done again from the
    # last one saved, whose checkpoint the half-written one did not replace.
    cluster.run(_inject, harness.session.id, "save", "kill", ranks=[1])
    with pytest.raises(EngineDied) as info:
        harness.session.step()
    assert info.value.rank == 1 and "crashed" not in str(info.value), str(info.value)
    harness.check_next_step()


def test_engine_killed_between_cells(harness):
    cluster = harness.cluster
    pids = harness.engine_pids()
    os.kill(pids[3], signal.SIGKILL)
    time.sleep(0.5)
    harness.check_next_step()                # never silently back to step 0
    now = harness.engine_pids()
    assert now[3] != pids[3] and now[:3] == pids[:3]


def test_stuck_rank_is_named_with_its_stack(harness):
    cluster, session = harness.cluster, harness.session
    pids = harness.engine_pids()
    cluster.run(_inject, session.id, 2, "hang", ranks=[1])
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        session.step()
    elapsed = time.monotonic() - t0
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3.0, elapsed          # a small overrun
    err = info.value
    assert err.ranks == [1] and "did not finish" in str(err) and "raised" not in str(err).split("\n")[0]
    assert "in fire" in err.stacks[1] and "sleep" not in err.stacks.get(0, "")   # where rank 1 was
    assert "in fire" in str(err)
    harness.check_next_step()
    now = harness.engine_pids()
    assert now[1] != pids[1] and [now[r] for r in (0, 2, 3)] == [pids[r] for r in (0, 2, 3)]


def test_peer_not_freed_by_a_failure_is_named_with_its_stack(harness):
    # Rank 1 raises as the step begins while rank 0 hangs outside communication (its connections
    # stay open): rank 2, waiting for rank 0's activations, is not freed either. After grace_s both
    # are killed, and the error says where each was.
    cluster, session = harness.cluster, harness.session
    pids = harness.engine_pids()
    cluster.run(_inject, session.id, 0, "hang", ranks=[0])
    cluster.run(_inject, session.id, 0, "raise", ranks=[1])
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        session.step()
    elapsed = time.monotonic() - t0
    err = info.value
    assert type(err) is RankError and err.rank == 1 and "injected failure at 0" in err.remote_traceback
    assert sorted(err.unreleased) == [0, 2], err
    assert "in fire" in err.unreleased[0]                                           # where rank 0 hung
    assert "in fire" not in err.unreleased[2] and "recv" in err.unreleased[2]       # rank 2 waited for it
    first = str(err).splitlines()[0]
    assert first == "rank 1 raised (ranks [0, 2] get new engines at the next call):", first
    assert "--- rank 0 (not freed by the failure within grace_s: killed) was at:" in str(err)
    assert cluster.grace_s <= elapsed < cluster.grace_s + REPORT_S, elapsed
    harness.check_next_step()
    now = harness.engine_pids()
    assert [now[r] != pids[r] for r in range(4)] == [True, False, True, False]


def _interrupt_later(delays):
    def send():
        for d in delays:
            time.sleep(d)
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=send, daemon=True).start()


def test_ctrl_c_during_train_finishes_the_step_in_flight(harness):
    session = harness.session
    done = len(session.history)
    for rank in (0, 3):                                       # slow steps, so the interrupt lands mid-step
        harness.cluster.run(_inject, session.id, 0, "slow", ranks=[rank])
    _interrupt_later([0.4])
    with pytest.raises(KeyboardInterrupt):
        session.train(50, progress=False)
    assert len(session.history) == done + 1                    # the step in flight finished and was recorded
    assert session.cursor is None
    harness.check_next_step()                                  # continues exactly: nothing applied twice


def test_second_ctrl_c_abandons_the_step(harness):
    session, cluster = harness.session, harness.cluster
    done = len(session.history)
    cluster.run(_inject, session.id, 1, "slow", ranks=[3])
    _interrupt_later([0.4, 0.2])
    with pytest.raises(KeyboardInterrupt):
        session.train(50, progress=False)
    assert len(session.history) == done                        # abandoned, not recorded
    harness.check_next_step()                                  # the last finished step was restored


def test_state_lost_is_said_never_silent(harness):
    # A session that keeps no step: an engine's death cannot be repaired, and the session says so.
    cluster = harness.cluster
    bare = cluster.session(CFG, keep_last_step=False)
    bare.step()
    bare.step()
    os.kill(cluster.info[0]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(StateLost, match=r"the state of step 2 is lost") as info:
        bare.step()
    assert info.value.step == 0 and bare.step_index == 0 and bare.history == []
    assert abs(bare.step()["loss"] - harness.ref_loss(0)) <= 1e-6 * harness.ref_loss(0)   # a clean restart
    bare.close()
    harness.check_next_step()                # the other session recovered its own last step


# ZeRO-3 under a zero-bubble V schedule: a failure while layers are gathered (or a gradient half
# reduced, or weight-gradient work queued between I and W) must leave the next step exact: the
# abandoned step's gathered parameters, partial shards and queued W work are dropped on every rank.
ZERO3_CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4), pp=2, dp=2,
                        zero=3, prefetch=1, schedule="zb-v", chunks=2, micro_batch_size=2, global_batch_size=8,
                        max_steps=200)
ZERO3_SWEEP = [(rank, point) for rank in (1, 2) for point in _points(rank, ZERO3_CFG)]


def test_zero3_recovers_from_a_failure_at_every_action_index():
    _sweep_on_own_cluster(ZERO3_CFG, ZERO3_SWEEP)
