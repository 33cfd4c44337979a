"""A real local ipyparallel cluster: ranks, interactive stepping, injected failures, clean shutdown."""

import json
import os
import signal
import stat
import time

import pytest
import torch

from mlmkit import Topology
from mlmkit.cluster import Cluster, EngineDied, RankError
from mlmkit.cluster.cluster import alive
from mlmkit.model import GPTConfig
from mlmkit.train import TrainConfig

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
    frame = cluster.run_frame(lambda r: {"pp": r.groups.coords.pp})
    assert list(frame.pp) == [0, 0, 1, 1]
    # Free-form %px-style code sees the rank object in the engine namespace.
    view = cluster.client[cluster.engine_ids]
    view.execute("answer = mlmkit_rank.rank * 100", block=True)
    assert view.pull("answer", block=True) == [0, 100, 200, 300]


def test_stepping_action_by_action_equals_whole_steps(cluster):
    stepped = cluster.session(CFG)
    losses_stepped, seen = [], set()
    for _ in range(2):
        while not stepped.step_done:
            done = stepped.step_action()
            seen.update(a.split("(")[0] for a in done.values() if a)
        state = stepped.state()
        assert set(state.next_action.dropna()) == set()
        losses_stepped.append(stepped.step()["loss"])
    assert {"F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"} <= seen
    whole = cluster.session(CFG)
    losses_whole = [whole.step()["loss"] for _ in range(2)]
    assert losses_stepped == losses_whole
    # Mid-step state: activations held with their shapes.
    whole.step_microbatch()
    st = whole.state()
    assert (st.position > 0).all() and (st.held_count > 0).any()
    assert whole.traces()["events"].groupby("rank").size().min() > 0


def _install_failure(r, kind):
    chunk = r.trainer.chunks[0]
    fired = []

    def hook(module, args):
        if not fired:
            fired.append(1)
            if kind == "raise":
                raise RuntimeError("injected failure in forward")
            os.kill(os.getpid(), signal.SIGKILL)

    chunk.register_forward_pre_hook(hook)


def test_rank_raising_in_forward_is_reported_and_next_step_works(cluster):
    session = cluster.session(CFG)
    session.step()
    cluster.run(_install_failure, "raise", ranks=[1])
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        session.step()
    assert time.monotonic() - t0 < 5.0
    assert info.value.rank == 1
    assert "injected failure in forward" in info.value.remote_traceback
    row = session.step()
    assert row["step"] == 1 and row["loss"] == row["loss"]


def _raise_while_peers_wait(r):
    if r.rank == 3:
        time.sleep(0.3)
        raise ValueError("rank 3 gives up")
    x = torch.ones(1)
    r.groups.world.all_reduce(x)      # ranks 0-2 wait here for rank 3
    return x.item()


def test_rank_raising_while_peers_wait_in_a_collective(cluster):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_raise_while_peers_wait)
    assert time.monotonic() - t0 < 5.0
    assert info.value.rank == 3 and "rank 3 gives up" in info.value.remote_traceback
    assert set(info.value.others) <= {0, 1, 2}

    assert cluster.run(_world_sum_of_ones) == {r: 4.0 for r in range(4)}


def test_engine_killed_mid_step_is_replaced(cluster):
    session = cluster.session(CFG)
    session.step()
    old_pid = cluster.info[2]["pid"]
    cluster.run(_install_failure, "kill", ranks=[2])
    t0 = time.monotonic()
    with pytest.raises(EngineDied) as info:
        session.step()
    assert time.monotonic() - t0 < 30.0
    assert info.value.rank == 2
    assert cluster.info[2]["pid"] != old_pid and alive([old_pid]) == []
    row = session.step()            # rebuilt on the new engine (no checkpoint: from step 0)
    assert row["loss"] == row["loss"]


def test_two_engine_cluster_is_private_and_leaves_nothing_behind():
    with Cluster(n=2) as c:
        pids = c.pids()
        assert len(pids) >= 4          # 2 engines, their nannies, the controller (and its schedulers)
        sec = os.path.join(c._profile_dir, "security")
        for f in os.listdir(sec):
            mode = stat.S_IMODE(os.stat(os.path.join(sec, f)).st_mode)
            assert mode == 0o600, (f, oct(mode))
            data = json.load(open(os.path.join(sec, f)))
            if "interface" in data:
                assert data["interface"] == "tcp://127.0.0.1", data
        # Every socket the controller listens on is bound to the loopback address.
        import psutil

        ctrl = c.ipp_cluster.controller.process.pid
        listening = [conn.laddr.ip for p in [ctrl, *(q.pid for q in psutil.Process(ctrl).children(recursive=True))]
                     for conn in psutil.Process(p).net_connections(kind="tcp") if conn.status == psutil.CONN_LISTEN]
        assert listening and set(listening) == {"127.0.0.1"}, listening
        assert c.run(lambda r: r.groups.dp.size) == {0: 2, 1: 2}
    assert alive(pids) == []


def test_bad_cluster_configs_fail_before_starting():
    with pytest.raises(ValueError, match="n=3 engines but Topology"):
        Cluster(topology=Topology(tp=2), n=3)
    with pytest.raises(ValueError, match="give topology"):
        Cluster()


def test_session_controls_buttons(cluster):
    from mlmkit.viz import SessionControls

    controls = SessionControls(cluster.session(CFG))
    controls.action_button.click()
    assert controls.last and any(controls.last.values())
    assert (controls.state.position >= 0).all()
    controls.microbatch_button.click()
    assert controls.figure is not None and controls.error is None
    controls.step_button.click()
    assert "steps done: 1" in controls.status.value
    controls.reset_button.click()
    assert (controls.state.position == controls.state.actions).all() or (controls.state.position == 0).all()


def test_kernel_killed_abruptly_leaves_no_process(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text("import time\nfrom mlmkit.cluster import Cluster\nc = Cluster(n=2).start()\n"
                      "print(' '.join(map(str, sorted(c.pids()))), flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) >= 4
    proc.kill()                                   # like a notebook kernel killed with SIGKILL
    proc.wait()
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(pids) == []
