"""The multi-rank harness (errors and hangs never pass silently) and per-rank process groups."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, RankFailure, RankTimeout, run_ranks
from mlmkit.trace import Tracer


def _sum_of_ranks(rank, world_size, scale):
    x = torch.tensor([float(rank) * scale])
    dist.all_reduce(x)
    return rank, x.item()


def test_results_come_back_by_rank():
    out = run_ranks(_sum_of_ranks, world_size=4, args=(2.0,), timeout_s=60)
    assert out == [(r, 2.0 * (0 + 1 + 2 + 3)) for r in range(4)]
    # Numbers read from a table are numpy's: a numpy timeout was refused as "not a number", and
    # reached timedelta (which refuses numpy integers) once let through.
    import numpy as np

    out = run_ranks(_sum_of_ranks, world_size=np.int64(2), args=(1.0,), timeout_s=np.int64(60),
                    collective_timeout_s=np.float32(30), threads=np.int64(1))
    assert out == [(0, 1.0), (1, 1.0)]


def test_a_slurm_tasks_view_of_its_node():
    # Tasks on this rank's node (each rank's torch threads are the node's CPUs shared among them):
    # Slurm writes uneven nodes as "2(x3),1"; every rank once read the first node's count (a rank on
    # the last node, alone there, took half its CPUs), and "--ntasks-per-node" the job's setting.
    from mlmkit.distributed.rendezvous import _tasks_per_node, job_env

    assert _tasks_per_node("2(x3),1") == [2, 2, 2, 1] and _tasks_per_node("4") == [4]
    base = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    job = job_env({**base, "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"})
    assert (job.rank, job.world_size, job.local_world_size, job.launcher, job.master_port) == (6, 7, 1, "slurm", 29500)
    assert job_env({**base, "SLURM_STEP_TASKS_PER_NODE": "3,4", "SLURM_TASKS_PER_NODE": "4(x2)",
                    "SLURM_NODEID": "0"}).local_world_size == 3
    assert job_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    assert job_env({}).launcher == "none"


def _raise_on_rank_2(rank, world_size):
    if rank == 2:
        raise KeyError("boom on purpose")
    x = torch.ones(1)
    dist.all_reduce(x)  # peers block here: rank 2 never joins
    return x.item()


def test_raising_rank_is_named_and_peers_freed():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_2, world_size=4, timeout_s=60)
    assert info.value.rank == 2
    assert "KeyError: 'boom on purpose'" in info.value.remote_traceback
    assert "_raise_on_rank_2" in info.value.remote_traceback
    assert time.monotonic() - start < 30  # the blocked peers were killed, not waited for


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def test_hung_rank_is_killed_and_reported():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_1, world_size=3, timeout_s=4, collective_timeout_s=600)
    assert sorted(info.value.ranks) == [0, 1, 2]
    assert "_hang_on_rank_1" in info.value.stacks[1]  # where rank 1 was stuck
    assert time.monotonic() - start < 30


def _die_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(7)
    time.sleep(3600)


def _crash_in_cpp_on_rank_1(rank, world_size):
    if rank == 1:
        os.abort()                      # what std::terminate or a failed assertion in a library does
    time.sleep(3600)


def test_rank_that_dies_is_reported():
    with pytest.raises(RankFailure) as info:
        run_ranks(_die_on_rank_0, world_size=2, timeout_s=30)
    assert info.value.rank == 0 and info.value.exitcode == 7
    assert "Fatal Python error" not in str(info.value)
    # A crash says where: faulthandler's stack of the crashed rank (it said only "exited with code -6").
    with pytest.raises(RankFailure) as info:
        run_ranks(_crash_in_cpp_on_rank_1, world_size=2, timeout_s=30)
    text = str(info.value)
    assert info.value.rank == 1 and info.value.exitcode == -6, text
    assert "Fatal Python error: Aborted" in text and "_crash_in_cpp_on_rank_1" in text, text
    assert "Extension modules" not in text, text


def _imported_at_start(rank, world_size, names):
    import sys

    return {name: name in sys.modules for name in names}


def test_ranks_start_with_the_trainer_and_the_preloaded_modules_imported():
    # The forkserver imports PRELOAD once (the trainer), and what preload_in_ranks names from then
    # on: a rank starts with them in sys.modules instead of importing them itself. Preloading while
    # the forkserver runs restarts it with the longer list.
    from mlmkit.distributed import preload_in_ranks
    from mlmkit.distributed.launch import PRELOAD

    names = ["mlmkit.train.trainer", "tabnanny"]      # tabnanny: a module nothing here imports
    assert "mlmkit.train.trainer" in PRELOAD
    before = run_ranks(_imported_at_start, world_size=2, args=(names,), timeout_s=60)
    assert before == [{"mlmkit.train.trainer": True, "tabnanny": False}] * 2
    assert preload_in_ranks(["tabnanny"])[-1] == "tabnanny"
    assert preload_in_ranks(["tabnanny"]).count("tabnanny") == 1          # named once
    after = run_ranks(_imported_at_start, world_size=2, args=(names,), timeout_s=60)
    assert after == [{"mlmkit.train.trainer": True, "tabnanny": True}] * 2


@pytest.mark.parametrize("modules,needle", [
    ("tabnanny", "modules='tabnanny' must be a list of module names"),
    (["no_such_module_xyz"], "module 'no_such_module_xyz' cannot be imported in this process (ModuleNotFoundError"),
    ([""], "must be a list of module names"),
])
def test_preload_refuses_what_the_forkserver_could_not_import(modules, needle):
    from mlmkit.distributed import preload_in_ranks
    from mlmkit.distributed.launch import _PRELOADED

    before = list(_PRELOADED)
    with pytest.raises(ValueError, match=re.escape(needle)):
        preload_in_ranks(modules)
    assert _PRELOADED == before
    assert run_ranks(_sum_of_ranks, world_size=2, args=(1.0,), timeout_s=60) == [(0, 1.0), (1, 1.0)]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=0), "world_size=0 must be an integer >= 1"),
    (dict(world_size=True), "world_size=True must be an integer >= 1"),
    # these started every process first: a negative timeout then killed all ranks as hung, threads=0
    # failed in each rank, an unknown backend once the processes were up
    (dict(world_size=2, timeout_s=-1), "timeout_s=-1 must be a finite number of seconds > 0"),
    (dict(world_size=2, timeout_s=float("nan")), "timeout_s=nan must be a finite number of seconds > 0"),
    (dict(world_size=2, collective_timeout_s=0), "collective_timeout_s=0 must be a finite number of seconds > 0"),
    (dict(world_size=2, threads=0), "threads=0 must be an integer >= 1"),
    (dict(world_size=2, backend="Gloo"), "backend='Gloo': expected 'gloo', 'nccl' or None"),
    (dict(world_size=2, port_retries=-1), "port_retries=-1 must be an integer >= 0"),
    # more CPU ranks than the memory holds (each a process with torch): refused, not started until
    # the machine runs out of memory
    (dict(world_size=100000, backend="gloo"), "world_size=100000 is more than this machine can run"),
])
def test_bad_run_ranks_arguments_fail_before_any_process(kwargs, needle):
    import psutil

    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=re.escape(needle)):
        run_ranks(_sum_of_ranks, args=(1.0,), **kwargs)
    assert set(psutil.Process().children(recursive=True)) == before


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_ranks_get_a_gpu_each_or_run_on_the_cpu(monkeypatch, gpus):
    # On a machine with fewer GPUs than ranks, nccl put two ranks on one GPU (NCCL fails in its
    # set-up) and gloo ranks placed their tensors on the GPU (gloo's sends and reduce-scatters take
    # CPU tensors): the tests could not run on a one-GPU workstation. The CUDA state is set here,
    # the rule under test is mlmkit's (the CUDA path itself runs where a GPU is lent).
    from mlmkit.distributed import default_device
    from mlmkit.distributed.launch import _local_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for world_size in (1, 2, 4):
        want = "nccl" if world_size <= gpus else "gloo"
        assert _local_backend(None, world_size) == want, (gpus, world_size)
        assert _local_backend("gloo", world_size) == "gloo"
        if world_size <= gpus:
            assert _local_backend("nccl", world_size) == "nccl"
        else:
            needle = (f"backend='nccl' gives each rank a GPU of its own, and this machine has {gpus} GPU(s) for "
                      f"world_size={world_size}: use at most {gpus} ranks, or backend='gloo'") if gpus else \
                "backend='nccl' needs CUDA, which this machine does not have"
            with pytest.raises(ValueError, match=re.escape(needle)):
                run_ranks(_sum_of_ranks, world_size=world_size, backend="nccl", args=(1.0,))
    assert default_device(0, backend="gloo") == torch.device("cpu")
    assert default_device(1, backend="nccl").type == ("cuda" if gpus else "cpu")


def _groups_and_collectives(rank, world_size, tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(topo, tracer=tracer)
    out = {"coords": tuple(groups.coords)}
    for axis in ("tp", "dp", "pp", "embedding"):
        g = getattr(groups, axis)
        if g is None:
            out[axis] = None
            continue
        x = torch.tensor([float(rank)])
        g.all_reduce(x, site=f"test.{axis}")
        out[axis] = (list(g.ranks), x.item())
    # all-gather / reduce-scatter along a non-leading dim
    t = torch.full((2, groups.tp.size * 2), float(rank))
    gathered = groups.tp.all_gather(t, dim=1)
    scattered = groups.tp.reduce_scatter(gathered, dim=1)
    out["ag_shape"] = tuple(gathered.shape)
    out["rs"] = scattered
    out["comm"] = tracer.comm_frame()
    return out


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 2, 1), (1, 4, 2)])
def test_process_groups_match_topology(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    results = run_ranks(_groups_and_collectives, world_size=8, args=(tp, pp, dp), timeout_s=120)
    for rank, res in enumerate(results):
        assert res["coords"] == tuple(topo.coords(rank))
        for axis in ("tp", "dp", "pp", "embedding"):
            expected = topo.group_of(axis, rank)
            if not expected:
                assert res[axis] is None
                continue
            ranks, total = res[axis]
            assert ranks == expected
            assert total == float(sum(expected))
        assert res["ag_shape"] == (2, tp * 2 * tp)
        # Every member holds the same gathered tensor; the reduce-scatter sums tp copies of it and
        # hands back this rank's slice, i.e. tp * (this rank's original values).
        assert torch.equal(res["rs"], torch.full((2, 2 * tp), float(tp * rank)))
        comm = res["comm"]
        # Every multi-rank collective was traced with its axis and bytes; size-1 groups record nothing.
        ar = comm[comm.op == "all_reduce"]
        assert set(ar.axis) == {a for a in ("tp", "dp", "pp", "embedding") if len(topo.group_of(a, rank)) > 1}
        assert (ar.bytes == 4).all()


def test_build_without_init_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not initialised"):
        ProcessGroups.build(Topology())


def _wrong_world(rank, world_size):
    ProcessGroups.build(Topology(tp=2, pp=2))


def test_build_with_wrong_world_size():
    with pytest.raises(RankFailure, match=r"world size 2 does not match"):
        run_ranks(_wrong_world, world_size=2, timeout_s=60)


def _malloc_probe(rank, world_size):
    from tests.malloc_probe import probe

    return probe()


@pytest.mark.skipif(os.uname().sysname != "Linux" or torch.cuda.is_available(),
                    reason="CPU ranks with glibc's allocator (Linux, no CUDA)")
def test_cpu_ranks_keep_freed_host_memory_between_steps():
    """A CPU rank started by mlmkit keeps freed blocks of a microbatch's size in its heap (served
    from the heap, never trimmed), so the next step reuses them instead of faulting the pages in
    again (mlmkit.distributed.host_memory). The control, a fresh interpreter with glibc's own
    settings, maps each block on its own at first and, once glibc raised its threshold, gives the
    freed heap back to the kernel: the probe sees a missing setting."""
    import json
    import subprocess
    import sys

    for rank, rounds in enumerate(run_ranks(_malloc_probe, world_size=2, timeout_s=120)):
        assert rounds == [{"mmapped": 0, "trimmed_bytes": 0}] * 2, f"rank {rank}: {rounds}"
    plain = json.loads(subprocess.run([sys.executable, "-m", "tests.malloc_probe"], capture_output=True,
                                      text=True, check=True,
                                      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout)
    assert sum(r["mmapped"] for r in plain) > 0 and sum(r["trimmed_bytes"] for r in plain) > 0, plain


@pytest.mark.parametrize("kwargs, needle", [
    (dict(trim_threshold=0), "trim_threshold=0"),
    (dict(mmap_threshold=-1), "mmap_threshold=-1"),
    (dict(trim_threshold=True), "trim_threshold=True"),
    (dict(mmap_threshold=1.5), "mmap_threshold=1.5"),
])
def test_keep_freed_memory_refuses_bad_thresholds(kwargs, needle):
    from mlmkit.distributed import keep_freed_memory

    with pytest.raises(ValueError, match=re.escape(needle) + ".*positive number of bytes"):
        keep_freed_memory(**kwargs)


def _ring_with_a_dropped_peer(rank, world_size, flag):
    # A ring of 3: rank 2 drops its groups (as a failing rank does), rank 0's shift sends to rank 1
    # and receives from rank 2, and rank 1 comes to the shift only after rank 0 has written
    # ``flag`` (or 20 s). Rank 0 must learn of the failure from its receive: its send waits for
    # rank 1's receive, which rank 1 has not posted.
    groups = ProcessGroups.build(Topology(cp=3))
    if rank == 2:
        pg = groups.cp.pg
        groups.drop()
        dist.destroy_process_group(pg)        # its connections close, as a failing rank's do
        return pg is not dist.group.WORLD
    if rank == 0:
        shift = groups.cp.ring_shift(torch.ones(4), site="test")
        try:
            shift.wait()
            outcome = "received"
        except RuntimeError as err:
            outcome = f"raised: {err}"
        with open(flag, "w") as f:
            f.write(outcome)
        return outcome
    deadline = time.monotonic() + 20
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(flag)


def test_a_ring_shift_fails_on_its_receive_while_its_send_waits(tmp_path):
    # Context parallelism's ring: when the previous rank failed, wait() raises from the receive at
    # once instead of waiting first for the send to the next rank (which may never complete, see
    # PipelineExecutor.wait_sends), so the rank is released like its peers.
    flag = str(tmp_path / "rank0-done")
    outcome, saw_flag, own_group = run_ranks(_ring_with_a_dropped_peer, world_size=3, args=(flag,), timeout_s=60,
                                             collective_timeout_s=40)
    assert own_group and outcome.startswith("raised"), outcome
    assert saw_flag, "rank 0 waited for its send to rank 1 before its failed receive from rank 2"


def test_a_store_socket_bound_first_serves_ranks_that_connect_before_the_store_starts():
    # The cluster binds rank 0's store socket before it tells the other ranks the port (a rank
    # that finds nothing listening backs off about half a second): a rank connecting before the
    # store exists waits in the socket's backlog, and the store then serves it.
    import threading

    from mlmkit.distributed.process_groups import listening_socket, rendezvous_store

    sock = listening_socket("127.0.0.1")
    port = sock.getsockname()[1]
    clients = {}
    joining = threading.Thread(target=lambda: clients.update(
        store=rendezvous_store(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=10)))
    joining.start()
    time.sleep(0.2)                                   # rank 1 is connecting; no store serves yet
    assert "store" not in clients
    server = rendezvous_store(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=10, listen_socket=sock)
    joining.join(10)
    server.set("from rank 0", "hello")
    assert clients["store"].get("from rank 0") == b"hello"
    other = listening_socket("127.0.0.1")
    with pytest.raises(ValueError, match=rf"listen_socket is bound to port {other.getsockname()[1]}, not {port}"):
        rendezvous_store(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=10, listen_socket=other)
    other.close()
