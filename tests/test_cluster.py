"""A real local ipyparallel cluster: ranks, interactive stepping, injected failures, clean shutdown."""

import dataclasses
import gc
import glob
import json
import os
import re
import stat
import tempfile
import time

import pytest
import torch

from mlmkit import Topology
from mlmkit.cluster import Cluster, RankError
from mlmkit.cluster.cluster import alive
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig
from mlmkit.train.checkpoint import latest_checkpoint

CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4), tp=2, pp=2,
                  micro_batch_size=2, global_batch_size=8)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(topology=Topology(tp=2, pp=2), timeout_s=60)
    c.start()
    yield c
    pids = c.pids()
    c.shutdown()
    assert alive(pids) == []


def _world_sum_of_ranks(r):
    x = torch.tensor([float(r.rank)])
    r.groups.world.all_reduce(x)
    return x.item()


def _world_sum_of_ones(r):
    x = torch.ones(1)
    r.groups.world.all_reduce(x)
    return x.item()


def test_ranks_display_and_run(cluster):
    df = cluster.to_frame()
    assert list(df.index) == [0, 1, 2, 3]
    assert list(df.pp) == [0, 0, 1, 1] and list(df.tp) == [0, 1, 0, 1]
    assert set(df.device) == {"cpu"}
    assert "Topology(tp=2, pp=2, dp=1)" in cluster._repr_html_()
    assert cluster.run(lambda r: list(r.groups.tp.ranks)) == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}

    assert cluster.run(_world_sum_of_ranks) == {r: 6.0 for r in range(4)}
    assert cluster.run(lambda r: r.rank * 10, ranks=[1, 3]) == {1: 10, 3: 30}
    picked = cluster.run(lambda r: r.rank, ranks=df[df.pp == 1].index.to_numpy())      # numpy integers
    assert picked == {2: 2, 3: 3} and all(type(r) is int for r in picked)
    # A bad per-call timeout is refused before anything runs (-1 stopped every rank as hung)
    for bad in (-1, 0, float("nan"), True):
        with pytest.raises(ValueError, match=rf"timeout_s={bad!r} must be a number of seconds"):
            cluster.run(lambda r: r.rank, timeout_s=bad)
    assert cluster.run(lambda r: r.rank, timeout_s=30) == {r: r for r in range(4)}
    frame = cluster.run_frame(lambda r: {"pp": r.groups.coords.pp})
    assert list(frame.pp) == [0, 0, 1, 1]
    # Free-form %px-style code sees the rank object in the engine namespace.
    view = cluster.client[cluster.engine_ids]
    view.execute("answer = mlmkit_rank.rank * 100", block=True)
    assert view.pull("answer", block=True) == [0, 100, 200, 300]


def _malloc_probe(r):
    from tests.malloc_probe import probe

    return probe()


@pytest.mark.skipif(os.uname().sysname != "Linux" or torch.cuda.is_available(),
                    reason="CPU engines with glibc's allocator (Linux, no CUDA)")
def test_engines_keep_freed_host_memory_between_steps(cluster):
    # As ranks of run_ranks (tests/test_distributed.py, with the control): a CPU engine keeps freed
    # blocks of a microbatch's size in its heap (neither mapped on their own nor trimmed).
    for rank, rounds in cluster.run(_malloc_probe).items():
        assert rounds == [{"mmapped": 0, "trimmed_bytes": 0}] * 2, f"engine of rank {rank}: {rounds}"


def _collector_facts(state):
    import gc
    import time

    t0 = time.process_time()
    gc.collect()
    return {"frozen": gc.get_freeze_count(), "collect_cpu_s": time.process_time() - t0}


def test_engines_freeze_their_imports_for_the_cycle_collector(cluster):
    # A failure's abort runs a full collection on every rank: with torch's ~290,000 objects frozen
    # it costs a millisecond instead of 0.15-0.2 s of CPU (engine._freeze_imports). The CPU time is
    # printed, not asserted (noisy machines); the frozen count is the check.
    facts = cluster.run(_collector_facts)
    print({r: round(f["collect_cpu_s"], 4) for r, f in facts.items()})
    assert all(f["frozen"] > 100_000 for f in facts.values()), facts


def _shift_boot_time(state, seconds):
    # What a slewed or stepped wall clock looks like to psutil on Linux: the boot time it adds to a
    # process's start ticks is the wall clock minus the uptime, in whole seconds.
    import psutil._pslinux as pslinux

    if seconds:
        state.data["boot_time"] = pslinux.boot_time
        shifted = state.data["boot_time"]
        pslinux.boot_time = lambda: shifted() + seconds
    else:
        pslinux.boot_time = state.data.pop("boot_time")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux's clock-tick start times")
def test_engines_outlive_a_wall_clock_that_moves(cluster):
    # Each engine's watchdog stops it when the driver is gone, and knows the driver by when it
    # started. That was psutil's create_time(), which moves with the wall clock on Linux: a clock
    # slewed by a second (CI saw it: "Engine 0 died" while a notebook started its cluster) made a
    # live driver look dead, and the engine exited without a word.
    pids = [inf["pid"] for inf in cluster.info]
    cluster.run(_shift_boot_time, 1)
    try:
        time.sleep(2.5)                     # the watchdog looks every second
        assert alive(pids) == pids
        assert cluster.run(_world_sum_of_ones) == {r: 4.0 for r in range(4)}
    finally:
        if alive(pids) == pids:
            cluster.run(_shift_boot_time, 0)
    assert [inf["pid"] for inf in cluster.info] == pids       # not replaced


_REAPER = """
import sys
import psutil._pslinux as pslinux
boot_time = pslinux.boot_time
pslinux.boot_time = lambda: boot_time() + 1      # the wall clock moved since the driver's token
from mlmkit.cluster.reaper import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux's clock-tick start times")
@pytest.mark.parametrize("driver", ["alive", "gone"])
def test_the_watchdog_process_knows_its_driver_by_its_start(tmp_path, driver):
    # The watchdog that stops a cluster whose kernel died: a live driver (seen through a moved
    # clock) keeps the cluster; a gone one (its pid's token names another process) does not.
    import subprocess
    import sys

    from mlmkit.cluster.reaper import start_token, write_pids

    victim = subprocess.Popen(["sleep", "60"])
    folder = tmp_path / "private"
    folder.mkdir()
    pids_file = str(folder / "pids")
    write_pids(pids_file, [victim.pid])
    if driver == "alive":
        token = start_token(os.getpid())
    else:
        gone = subprocess.Popen(["true"])
        token = start_token(gone.pid)
        gone.wait()
        assert start_token(gone.pid) is None
        assert token != start_token(os.getpid())
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), token, pids_file, str(folder)])
    try:
        time.sleep(3.0)
        if driver == "alive":
            assert victim.poll() is None and reaper.poll() is None and folder.exists()
            os.remove(pids_file)                  # what a normal shutdown does: the watchdog leaves
            assert reaper.wait(timeout=10) == 0 and victim.poll() is None
        else:
            assert victim.wait(timeout=10) == -9 and reaper.wait(timeout=10) == 0 and not folder.exists()
    finally:
        victim.kill()
        reaper.kill()
        victim.wait()
        reaper.wait()


@pytest.mark.parametrize("batch_p2p", [False, True], ids=["tagged", "batched"])
def test_stepping_action_by_action_equals_whole_steps(cluster, batch_p2p, monkeypatch):
    # Batched: the lockstep rounds of the batch plan (a batch and its peers' counterparts together).
    stepped = cluster.session(CFG.replace(batch_p2p=batch_p2p))
    losses_stepped, seen, batches = [], set(), 0
    for _ in range(2):
        while not stepped.step_done:
            done = stepped.step_action()
            for a in done.values():
                seen.update(re.findall(r"(SEND_ACT|RECV_ACT|SEND_GRAD|RECV_GRAD|F|B)\(", a or ""))
                batches += " + " in (a or "")
        state = stepped.state()
        assert set(state.next_action.dropna()) == set()
        losses_stepped.append(stepped.step()["loss"])
    assert {"F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"} <= seen
    assert (batches > 0) == batch_p2p          # batched: a send and a receive posted together
    whole = cluster.session(CFG)
    # A whole step is one call to the engines (begin, actions, update, save: each call is a round
    # trip through the controller), and the save is of the step it finished.
    calls, run = [], cluster.run
    monkeypatch.setattr(cluster, "run", lambda fn, *a, **k: (calls.append(fn.__name__), run(fn, *a, **k))[1])
    losses_whole = [whole.step()["loss"] for _ in range(2)]
    monkeypatch.undo()
    assert calls == ["_whole_step", "_whole_step"], calls
    with open(os.path.join(latest_checkpoint(whole._snapshot_dir), "metadata.json")) as f:
        assert json.load(f)["step"] == 2
    assert losses_stepped == losses_whole
    # A step driven action by action took the notebook's time: no throughput is made of it.
    assert stepped.metrics()[["step_time", "tokens_per_s"]].isna().all().all()
    assert (whole.metrics().step_time > 0).all() and (whole.metrics().tokens_per_s > 0).all()
    # Mid-step state: activations held with their shapes.
    whole.step_microbatch()
    st = whole.state()
    assert (st.position > 0).all() and (st.held_count > 0).any()
    assert whole.traces()["events"].groupby("rank").size().min() > 0


def test_stepping_a_v_schedule_at_four_stages_equals_whole_steps():
    # zb-v at pp=4: rank 3 receives activations and gradients from rank 2 in another order than rank 2
    # sends them. The driver must let a receive go only once its own message was sent (a count of
    # messages per pair let rank 3 block in a receive; the engine hung until the 60 s timeout).
    # Action by action on real engines, both communication paths, against whole steps.
    cfg = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=8, hidden=16, heads=2, layers=8), pp=4,
                      schedule="zb-v", chunks=2, micro_batch_size=1, global_batch_size=8)
    with Cluster(topology=cfg.topology, timeout_s=60) as four:
        whole = four.session(cfg)
        reference = [whole.step()["loss"] for _ in range(2)]
        whole.close()
        for batch_p2p in (False, True):
            stepped = four.session(cfg.replace(batch_p2p=batch_p2p))
            losses = []
            for _ in range(2):
                while not stepped.step_done:
                    stepped.step_action()
                losses.append(stepped.step()["loss"])
            stepped.close()
            assert losses == reference, batch_p2p


def test_sessions_on_one_cluster_each_keep_their_own_traces(cluster, tmp_path):
    # The engines' process groups serve every session. Each session's trainer took the groups'
    # tracer, which the first session had set: after a session with tracing=False, no later session
    # recorded anything, and sessions with tracing on wrote their rows into each other's traces.
    quiet = cluster.session(CFG.replace(tracing=False), checkpoint_dir=str(tmp_path / "quiet"), save_every_step=True)
    loud = cluster.session(CFG)
    other = cluster.session(CFG)
    try:
        loud.step()
        mine = loud.traces()
        assert len(mine["events"]) and len(mine["comm"]) and set(mine["events"].step) == {0}
        quiet.step()                              # and its checkpoint's collectives
        other.step()
        other.step()
        assert len(quiet.traces()["events"]) == len(quiet.traces()["comm"]) == 0
        after = loud.traces()
        assert len(after["events"]) == len(mine["events"]) and len(after["comm"]) == len(mine["comm"])
        theirs = other.traces()
        assert len(theirs["events"]) == 2 * len(mine["events"]) and len(theirs["comm"]) == 2 * len(mine["comm"])
        assert set(theirs["events"].step) == {0, 1}
        # Reading another session while one is half-way through a step takes none of its rows.
        for _ in range(3):
            loud.step_action()
        assert len(other.traces()["comm"]) == len(theirs["comm"]) and len(quiet.state())
        loud.step()
        assert len(loud.traces()["comm"]) == 2 * len(mine["comm"]) and len(other.traces()["comm"]) == len(theirs["comm"])
    finally:
        for s in (quiet, loud, other):
            s.close()


def _raise_while_peers_wait(r):
    if r.rank == 3:
        time.sleep(0.3)
        raise ValueError("rank 3 gives up")
    x = torch.ones(1)
    r.groups.world.all_reduce(x)      # ranks 0-2 wait here for rank 3
    return x.item()


def test_rank_raising_while_peers_wait_in_a_collective(cluster):
    # Sessions (with their optimizers) exist on these engines: nothing may keep a failed rank's
    # connections open, or its blocked peers would be killed instead of released.
    cluster.session(CFG).step()
    pids = [inf["pid"] for inf in cluster.info]
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_raise_while_peers_wait)
    assert time.monotonic() - t0 < 5.0
    assert info.value.rank == 3 and "rank 3 gives up" in info.value.remote_traceback
    assert set(info.value.others) <= {0, 1, 2}

    assert cluster.run(_world_sum_of_ones) == {r: 4.0 for r in range(4)}
    assert [inf["pid"] for inf in cluster.info] == pids      # released, not killed and replaced


def _listening(pids):
    import psutil

    out = []
    for p in pids:
        try:
            out += [(p, c.laddr.ip) for c in psutil.Process(p).net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "own-process"])
def test_two_engine_cluster_is_private_and_leaves_nothing_behind(fork):
    import psutil

    with Cluster(n=2, fork_engines=fork) as c:
        pids = c.pids()
        assert len(pids) >= 4          # 2 engines, their nannies, the controller (and its schedulers)
        # Forked: both engines are children of one zygote, which imported torch once; otherwise each
        # engine is its own `python -m ipyparallel.engine`, started by the driver.
        parents = {psutil.Process(inf["pid"]).ppid() for inf in c.info}
        if fork:
            (zygote,) = parents
            assert "mlmkit.cluster.zygote" in psutil.Process(zygote).cmdline() and zygote in pids
        else:
            assert parents == {os.getpid()}
            assert all("ipyparallel.engine" in psutil.Process(inf["pid"]).cmdline() for inf in c.info)
        # torch works after the fork: its thread pool is built in the engine, with the rank's threads.
        got = c.run(lambda r: (torch.get_num_threads(), float(torch.ones(256, 256).matmul(torch.ones(256, 256)).sum())))
        assert got == {r: (c.setup[r]["threads"], 256.0 ** 3) for r in range(2)}, got
        folder = c.private_dir
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        sec = os.path.join(folder, "security")
        for f in os.listdir(sec):
            mode = stat.S_IMODE(os.stat(os.path.join(sec, f)).st_mode)
            assert mode == 0o600, (f, oct(mode))
            data = json.load(open(os.path.join(sec, f)))
            if "interface" in data:
                assert data["interface"] == "tcp://127.0.0.1", data
        assert c.run(lambda r: r.groups.dp.size) == {0: 2, 1: 2}
        # Every socket any process of the cluster listens on (controller, engines with their
        # torch.distributed store and gloo connections) is bound to the loopback address.
        listening = _listening(c.pids())
        assert listening and {ip for _, ip in listening} == {"127.0.0.1"}, listening
        engine_pids = {inf["pid"] for inf in c.info}
        assert engine_pids & {p for p, _ in listening}     # the engines' own sockets were seen
    assert alive(pids) == []
    assert not os.path.exists(folder)


def test_a_zygote_that_cannot_import_fails_the_start_with_its_error(tmp_path, monkeypatch):
    # The engines' zygote finds a torch that cannot be imported (the driver's is imported already):
    # the start fails at once with the zygote's own traceback, and leaves nothing running.
    import psutil

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('a torch broken for this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "mlmkit-ipp-*")))
    children = set(psutil.Process().children(recursive=True))
    with pytest.raises(RuntimeError, match=r"(?s)the engines' zygote exited with code 1 before forking 2 engines.*"
                                           r"ImportError: a torch broken for this test"):
        Cluster(n=2, fork_engines=True).start()      # not "did not fork ... in 120 s": it did not wait
    left = [p for p in set(psutil.Process().children(recursive=True)) - children if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "mlmkit-ipp-*"))) <= before


def test_the_zygote_forks_every_request_collects_its_children_and_exits_once_closed(tmp_path):
    # The protocol behind engine replacement: one zygote forks a cluster's first engines and, later,
    # the replacement of one that died, each child in its own session and log; it collects every
    # child that exits while it waits for the next request, and exits once the driver closes it and
    # its children are gone. (The children here run `ipengine --help`, which prints and exits.)
    import subprocess
    import sys

    import psutil

    zygote = subprocess.Popen([sys.executable, "-m", "mlmkit.cluster.zygote", str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)

    def fork(tag, n):
        outputs = [str(tmp_path / f"{tag}{i}.log") for i in range(n)]
        zygote.stdin.write(json.dumps({"argv": ["--help"], "outputs": outputs, "env": dict(os.environ)}).encode() + b"\n")
        zygote.stdin.flush()
        pids = [int(zygote.stdout.readline()) for _ in range(n)]
        return pids, outputs

    def gone(pids):                          # exited and collected: no zombie left behind
        deadline = time.monotonic() + 20
        while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return not any(psutil.pid_exists(p) for p in pids)

    try:
        first, logs = fork("first", 2)
        assert gone(first) and zygote.poll() is None          # collected, and still there for more
        again, more = fork("again", 1)
        assert set(again).isdisjoint(first) and gone(again)
        for log in logs + more:
            assert "Start an IPython engine" in open(log).read(), log
        zygote.stdin.close()
        assert zygote.wait(timeout=20) == 0
    finally:
        zygote.kill()


def test_the_zygote_forks_only_once_the_controller_file_is_whole(tmp_path):
    # The controller writes its connection file in place while the zygote imports; an engine that
    # read it half written would fail to start. The zygote waits until the file parses.
    import threading

    from mlmkit.cluster.zygote import _connection_file_complete, _wait_for

    path = tmp_path / "ipcontroller-engine.json"
    whole = json.dumps({"interface": "tcp://127.0.0.1", "registration": 50001, "key": "k"})
    assert not _connection_file_complete(str(path))                  # not there yet
    path.write_text(whole[:25])
    assert not _connection_file_complete(str(path))                  # half written
    finished = threading.Timer(0.3, path.write_text, args=(whole,))
    finished.start()
    _wait_for(str(path), wait_s=30)
    seen = path.read_text()                                          # what the engines would read now
    finished.join()
    assert seen == whole


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=10_000), r"n=10000 engines is more than this machine can run: each CPU engine takes about 0.4 GiB"),
    (dict(n=2, grace_s=-1), r"grace_s=-1 must be a number of seconds"),
    (dict(n=2, collective_timeout_s=-5), r"collective_timeout_s=-5 must be a number of seconds"),
    (dict(n=2, engine_start_timeout_s=0), r"engine_start_timeout_s=0 must be a number of seconds"),
    (dict(n=2, timeout_s=0), r"timeout_s=0 must be a number of seconds"),
    (dict(n=2, backend="mpi"), r"backend='mpi' is not a torch.distributed backend mlmkit uses"),
    (dict(n=2, backend="nccl"), r"backend='nccl' needs CUDA"),
    (dict(n=2, threads=0), r"threads=0 must be an integer >= 1"),
    (dict(n=2, profile="kubernetes"), r"no profile folder cluster/profile_kubernetes"),
    (dict(n=0), r"n=0 must be an integer >= 1"),
    (dict(n=2, fork_engines="yes"), r"fork_engines='yes' must be True, False or None"),
    (dict(n=2, fork_engines=True, profile="slurm"), r"fork_engines=True forks the engines on this host and needs Linux "
                                                   r"and profile='local' \(here 'linux', profile='slurm'\)"),
    (dict(topology=Topology(tp=2), n=3), r"n=3 engines but Topology"),
    (dict(), r"give topology"),
])
def test_bad_cluster_values_fail_before_any_process(kwargs, needle):
    import psutil

    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=needle):
        Cluster(**kwargs)
    assert set(psutil.Process().children(recursive=True)) == before


@pytest.mark.parametrize("gpus", [1, 4])
def test_a_cluster_with_fewer_gpus_than_engines_runs_them_on_the_cpu(monkeypatch, gpus):
    # With one GPU, the notebooks' 4-rank clusters refused to start (each engine takes a GPU):
    # without a backend they now run on the CPU with gloo and say so; backend='nccl' still refuses.
    # The CUDA state is set here (the rule under test is mlmkit's); nothing is started.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    topology = Topology(tp=2, pp=2)
    if gpus < topology.world_size:
        with pytest.warns(UserWarning, match=r"Cluster: 4 engines and 1 GPU\(s\) here: the engines run on the CPU "
                                             r"with gloo"):
            c = Cluster(topology=topology)
        assert (c.backend, c.fork_engines) == ("gloo", True)
        with pytest.raises(ValueError, match=r"Cluster: 4 engines but this machine has 1 GPU\(s\); each engine takes "
                                             r"one GPU with backend='nccl'"):
            Cluster(topology=topology, backend="nccl")
    else:
        c = Cluster(topology=topology)
        assert (c.backend, c.fork_engines) == (None, False)          # one GPU per engine, nccl
    assert Cluster(topology=topology, backend="gloo").backend == "gloo"


def test_stepping_a_microbatch_of_zero_bubble_does_not_wait_for_its_deferred_w(cluster):
    # zb-h1 defers the oldest microbatch's W to the drain (here the last action of rank 1): "one
    # microbatch" counting W ran the whole step in one press. It runs to the end of the oldest
    # microbatch's backward (I) on every rank; the deferred W's come with later presses.
    cfg = CFG.replace(schedule="zb-h1")
    whole = cluster.session(cfg)
    reference = whole.step()["loss"]
    whole.close()
    session = cluster.session(cfg)
    session.step_microbatch()
    done = {r: [str(a) for a in session.schedule.actions[r][:session.cursor.index[r]]] for r in range(2)}
    assert "I(mb=0)" in done[0] and "W(mb=0)" not in done[0] + done[1], done
    assert "I(mb=1)" not in done[1], done                          # it stopped there, not later
    presses = 1
    while not session.step_done:
        session.step_microbatch()
        presses += 1
    assert presses >= cfg.microbatches, presses
    assert session.step()["loss"] == reference
    session.close()


def test_a_config_for_another_grid_is_refused_with_the_fix(cluster):
    with pytest.raises(ValueError, match=r"the config asks for Topology\(tp=1, pp=2, dp=2\) but the cluster runs "
                                         r"Topology\(tp=2, pp=2, dp=1\): change the config's degrees to the "
                                         r"cluster's, or start a cluster for it \(Cluster\(topology=config.topology\)\)"):
        cluster.session(CFG.replace(tp=1, dp=2))
    # A corpus no engine could read is named here, not in a traceback from every engine.
    with pytest.raises(ValueError, match=r"corpus='/no/such/corpus.txt' does not exist"):
        cluster.session(CFG.replace(corpus="/no/such/corpus.txt"))


def test_a_relative_corpus_is_the_drivers_file(cluster, tmp_path, monkeypatch):
    # The driver checked a relative corpus in its own folder; the engines opened it in theirs (here
    # the folder the cluster started in; Slurm and MPI engines the cluster's private folder).
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    monkeypatch.chdir(tmp_path)
    session = cluster.session(CFG.replace(corpus="corpus.txt"))
    assert session.config.corpus == str(tmp_path / "corpus.txt")
    assert session.step()["loss"] > 0
    session.close()


def test_a_schedule_file_runs_its_order_on_the_engines_as_the_driver_read_it(cluster, tmp_path, monkeypatch):
    # A relative schedule file in the driver's folder: the engines run the order the driver read
    # and checked (carried with the config), even once the file is gone; the same order as zb-h1's
    # gives zb-h1's loss to the bit, and every rank runs the file's compute actions in order.
    from mlmkit.pipeline import to_torch_csv

    named = CFG.replace(schedule="zb-h1")
    whole = cluster.session(named)
    reference = whole.step()["loss"]
    whole.close()
    monkeypatch.chdir(tmp_path)
    to_torch_csv(named.pipeline_schedule(), "zbh1.csv")
    session = cluster.session(named.replace(schedule="zbh1.csv"))
    (tmp_path / "zbh1.csv").unlink()
    assert session.schedule.compute_actions(1) == named.pipeline_schedule().compute_actions(1)
    for _ in range(3):
        session.step_action()
    session.reset_step()                      # half a step dropped: every rank re-joins, the file gone
    assert session.step()["loss"] == reference
    events = session.traces()["events"].query("step == 0")
    for rank in range(4):
        ran = events[(events["rank"] == rank) & events["action"].isin(list("FBIW"))].sort_values("start")
        want = [(a.kind, a.microbatch) for a in named.pipeline_schedule().compute_actions(CFG.topology.coords(rank).pp)]
        assert list(zip(ran["action"], ran["microbatch"]))[-len(want):] == want, rank
    session.close()


def test_a_session_resumes_a_batch_checkpoint_and_saves_every_step(cluster, tmp_path):
    # Never tested before: a session given one checkpoint's folder (a batch job's step_000003)
    # started at step 0 without a word, a mistyped folder too, and a folder that was a file or held
    # another model's checkpoint failed on the engines with a traceback per rank.
    from mlmkit.distributed import ProcessGroups
    from mlmkit.train.checkpoint import save_checkpoint
    from mlmkit.train.trainer import Trainer

    serial = Trainer(CFG.replace(tp=1, pp=1), groups=ProcessGroups.single())    # the batch job, 1 process
    ref = []
    for step in range(5):
        if step == 3:
            save_checkpoint(serial, str(tmp_path / "batch"))
        ref.append(serial.train_step()["loss"])

    def close(got, want):
        return all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want, strict=True))

    for source in ("batch", "batch/step_000003"):          # a folder of checkpoints, or one checkpoint
        session = cluster.session(CFG, checkpoint_dir=str(tmp_path / source))
        assert session.step_index == 3, source
        assert close(session.train(2, progress=False).loss, ref[3:]), source
        session.close()
    every = str(tmp_path / "every")
    session = cluster.session(CFG, checkpoint_dir=every, save_every_step=True)   # missing: created
    assert session.step_index == 0 and close(session.train(2, progress=False).loss, ref[:2])
    session.close()
    assert open(os.path.join(every, "latest")).read() == "step_000002"
    session = cluster.session(CFG, checkpoint_dir=every)
    assert session.step_index == 2 and close([session.step()["loss"]], ref[2:3])
    session.close()
    # Saving every step into a batch job's folder keeps the job's checkpoints (they were deleted).
    session = cluster.session(CFG, checkpoint_dir=str(tmp_path / "batch"), save_every_step=True)
    assert close(session.train(2, progress=False).loss, ref[3:])
    session.close()
    assert sorted(os.listdir(tmp_path / "batch")) == ["latest", "step_000003", "step_000005"]

    (tmp_path / "a_file").write_text("")
    batch, a_file, typo = str(tmp_path / "batch"), str(tmp_path / "a_file"), str(tmp_path / "typo")
    for cfg, kwargs, needle in [
        (CFG, dict(checkpoint_dir=a_file, save_every_step=True), f"checkpoint_dir={a_file!r} is a file"),
        (CFG.replace(model=dict(kv_heads=2)), dict(checkpoint_dir=batch),
         f"checkpoint_dir={batch!r}: checkpoint {batch}/step_000005 was saved from another model configuration "
         f"(kv_heads: checkpoint None vs model 2)"),
        (CFG, dict(checkpoint_dir=typo), f"checkpoint_dir={typo!r}: no checkpoint at {typo}: the folder does not "
                                         f"exist (save_every_step=True starts there from step 0"),
        (CFG, dict(checkpoint_dir=batch + "/step_000003", save_every_step=True),
         "is one checkpoint's folder: to save every step, give the folder that holds it"),
    ]:
        with pytest.raises(ValueError) as err:
            cluster.session(cfg, **kwargs)
        assert str(err.value).startswith("Session: checkpoint_dir=") and needle in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"save_every_step=True saves the last step into checkpoint_dir, which "
                                         r"keep_last_step=False turns off: drop one of the two"):
        cluster.session(CFG, checkpoint_dir=every, save_every_step=True, keep_last_step=False)   # saved nothing
    with pytest.raises(ValueError, match=r"Session: keep_last_step='no' must be True or False"):
        cluster.session(CFG, keep_last_step="no")
    session = cluster.session(CFG)                           # the refusals left nothing on the engines
    assert close([session.step()["loss"]], ref[:1])
    session.close()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_reset_half_way_then_the_step_equals_an_uninterrupted_one(cluster, dropout):
    # Beside the widget's one reset: a reset after the first action and one in the steady state both
    # free the held activations, and the next step equals a fresh session's first step. With dropout
    # the reset puts the random streams back (the step run again drew other masks than an
    # uninterrupted run: another loss and other weights, and nothing said so).
    cfg = CFG.replace(model=dataclasses.replace(CFG.model, dropout=dropout))
    # The abandoned part's trace rows go too: they read as part of the step run again (10 extra
    # actions in step 0 and a bubble of 94%), and the trace's traffic was more than a step's.
    fresh = cluster.session(cfg)
    reference = [fresh.step() for _ in range(2)]
    keys = ["rank", "action", "microbatch", "chunk", "step"]
    ref_traces = fresh.traces()
    fresh.close()
    for actions, clear in ((1, False), (6, False), (6, True)):
        session = cluster.session(cfg)
        for _ in range(actions):
            session.step_action()
        if clear:
            session.traces(clear=True)            # half-way: the rows after it are dropped too
            session.step_action()
        session.reset_step()
        state = session.state()
        assert (state.activation_bytes == 0).all() and (state.held_count == 0).all(), actions
        assert len(session.traces()["events"]) == len(session.traces()["comm"]) == 0
        assert len(session.traces()["memory"]) == 0                  # memory rows go with the step
        rows = [session.step() for _ in range(2)]
        for got, want in zip(rows, reference):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (actions, rows, reference)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), (actions, rows, reference)
        traces = session.traces()
        assert sorted(map(tuple, traces["events"][keys].values.tolist())) == \
            sorted(map(tuple, ref_traces["events"][keys].values.tolist())), actions
        assert traces["comm"].groupby(["rank", "axis", "step"]).wire_bytes.sum().to_dict() == \
            ref_traces["comm"].groupby(["rank", "axis", "step"]).wire_bytes.sum().to_dict(), actions
        mem = ["rank", "action", "microbatch", "chunk", "step", "parameters", "gradients", "optimizer",
               "activations", "activations_peak"]
        assert sorted(map(tuple, traces["memory"][mem].values.tolist())) == \
            sorted(map(tuple, ref_traces["memory"][mem].values.tolist())), actions
        session.close()


def _session_ids(state):
    return sorted(state.trainers)


def test_a_session_closed_or_dropped_half_way_leaves_nothing_in_flight(cluster):
    # A session closed half-way through a step may have sends posted that no receive matched yet
    # (and receives posted ahead): on the same process groups and tags they would pair with the next
    # session's messages, a hang (60 s, then the engines replaced) or another step's activations
    # taken silently. Closed at several points of the step, or dropped without close (a notebook
    # cell re-run): the next session's steps equal a fresh session's. A live session half-way
    # through a step makes another session refuse to run.
    fresh = cluster.session(CFG)
    reference = [fresh.step()["loss"] for _ in range(2)]
    fresh.close()
    for actions in (1, 2, 5):
        half = cluster.session(CFG)
        for _ in range(actions):
            half.step_action()
        half.close()
        after = cluster.session(CFG)
        assert [after.step()["loss"] for _ in range(2)] == reference, actions
        after.close()
    half = cluster.session(CFG)
    half.step_action()
    half.step_action()
    folders = sorted(os.listdir(cluster.private_dir))
    with pytest.raises(RuntimeError, match=f"session {half.id} on this cluster has a step in progress"):
        cluster.session(CFG)
    assert sorted(os.listdir(cluster.private_dir)) == folders     # the refused session made no folder
    del half
    gc.collect()
    after = cluster.session(CFG)
    assert [after.step()["loss"] for _ in range(2)] == reference
    # Sessions dropped without close() between steps (a notebook cell run again): their trainers
    # (model, gradients, optimizer state on every engine) go when the next session is made.
    for _ in range(2):
        dropped = cluster.session(CFG)
        dropped.step()
        del dropped
        gc.collect()
    kept = cluster.session(CFG)
    held = cluster.run(_session_ids)
    assert all(sorted(ids) == sorted([after.id, kept.id]) for ids in held.values()), held
    kept.close()
    after.close()
    assert all(ids == [] for ids in cluster.run(_session_ids).values())


def test_session_controls_buttons(cluster):
    # The last test on this module's cluster: it shuts the cluster down at the end.
    from mlmkit.viz import SessionControls

    session = cluster.session(CFG)
    controls = SessionControls(session)
    tl = controls.timeline                              # between steps: the next step's plan, nothing done
    assert len(tl) == 2 * 2 * CFG.microbatches and not tl.done.any()
    assert set(tl.end - tl.start) <= {1.0, 2.0}         # logical time: slots, not seconds of thinking
    controls.action_button.click()
    assert controls.last and any(controls.last.values())
    assert (controls.state.position >= 0).all()
    controls.microbatch_button.click()
    assert controls.figure is not None and controls.error is None
    tl = controls.timeline
    assert tl.done.any() and not tl.done.all()          # part of the step done, the rest still to do
    assert (controls.state.activation_bytes > 0).any()
    # reset half-way through the step: the held activations are freed, and the next step runs clean
    # (it used to hang on the abandoned step's messages still in flight)
    controls.reset_button.click()
    assert controls.error is None, controls.error
    assert (controls.state.activation_bytes == 0).all() and (controls.state.held_count == 0).all()
    controls.step_button.click()
    assert controls.error is None and "steps done: 1" in controls.status.value
    fresh = cluster.session(CFG)
    fresh.step()
    assert session.metrics().loss.iloc[0] == pytest.approx(fresh.metrics().loss.iloc[0], abs=1e-6)
    fresh.close()
    bundle = controls._repr_mimebundle_()          # a static report shows the state where the widget stands
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "steps done: 1" in bundle["text/html"] and "plotly" in bundle["text/html"]
    # after shutdown a click says why nothing happens
    cluster.shutdown()
    controls.step_button.click()
    assert "shut down" in controls.status.value and controls.step_button.disabled


_KERNEL = """
import os, signal, sys, time
from mlmkit.cluster import Cluster
c = Cluster(n=2).start()
if sys.argv[1] == "replace":            # an engine dies and is replaced: the watchdog must follow
    os.kill(c.info[1]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    c.run(lambda r: r.rank)
print(c.private_dir, " ".join(map(str, sorted(c.pids()))), flush=True)
if sys.argv[1] == "exit":               # leave without shutdown()
    sys.exit(0)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["replace", "exit"])
def test_kernel_gone_leaves_no_process_or_folder(tmp_path, how):
    # "replace": an engine is replaced, then the notebook kernel is SIGKILLed and not reaped by its
    # parent yet (a zombie): the watchdogs must see it as gone and follow the replacement;
    # "exit": the kernel exits without shutdown().
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text(_KERNEL)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    folder, *pids = proc.stdout.readline().split()
    pids = [int(p) for p in pids]
    assert len(pids) >= 4 and os.path.isdir(folder)
    if how != "exit":
        proc.kill()                               # like a notebook kernel killed with SIGKILL; not waited for
    deadline = time.monotonic() + 20
    while (alive(pids) or os.path.exists(folder)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(pids) == [] and not os.path.exists(folder)
    proc.wait()


def test_starting_the_same_grid_again_stops_the_first(capsys):
    # A notebook cell `cluster = Cluster(...).start()` run twice: the first engines are stopped.
    first = Cluster(topology=Topology(), timeout_s=60).start()
    pids = first.pids()
    second = Cluster(topology=Topology(), timeout_s=60).start()
    try:
        assert not first.running and alive(pids) == []
        assert "stopping the 1-engine cluster" in capsys.readouterr().out
        assert second.run(lambda r: r.rank) == {0: 0}
    finally:
        second.shutdown()


def test_an_engine_that_ipyparallel_lost_is_dead_while_its_process_lingers():
    # ipyparallel answers the tasks of an engine it unregistered with a RemoteError named EngineError
    # (its stranded tasks), possibly before the engine's process is gone (one CI run reported a killed
    # engine as a rank that raised, and did not replace it). Its verdict counts: EngineDied, and the
    # rank gets a new engine at the next call. Here both "engines" are this live test process.
    from ipyparallel.error import RemoteError

    from mlmkit.cluster import EngineDied

    class Reply:                                 # an AsyncResult that has its answer
        def __init__(self, error=None):
            self.error = error

        def ready(self):
            return True

        def get(self, timeout):
            if self.error is not None:
                raise self.error
            return "done"

        def add_done_callback(self, fn):
            fn(self)

    cluster = Cluster(topology=Topology(dp=2))   # never started: only its bookkeeping is used
    cluster.info = [{"host": "here", "pid": os.getpid()}, {"host": "here", "pid": os.getpid()}]
    cluster._hostname = "here"
    lost = RemoteError("EngineError", "Engine 1 died while running task 'x'", "Traceback: EngineError")
    with pytest.raises(EngineDied) as info:
        cluster._wait({0: Reply(), 1: Reply(lost)}, timeout_s=5.0)
    assert info.value.rank == 1 and 1 in cluster._doomed
    # a task that raised on a live engine is still the rank's error, not a death
    raised = RemoteError("ValueError", "bad", "Traceback: ValueError: bad")
    with pytest.raises(RankError) as info:
        cluster._wait({0: Reply(), 1: Reply(raised)}, timeout_s=5.0)
    assert type(info.value) is RankError and info.value.rank == 1
