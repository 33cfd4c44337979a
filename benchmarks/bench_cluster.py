"""The notebook cluster on 4 engines: start time, and the round trip of one stepped call.

Start: ``Cluster.start()`` (engines + torch.distributed + process groups) against plain
ipyparallel ``Cluster.start_and_connect_sync()`` with the same engines (alternated).
Shutdown: ``Cluster.shutdown()`` (process groups dropped, engines then controller stopped, every
process gone) against ipyparallel's ``stop_cluster_sync()`` on its own engines, timed until every
process of that cluster (controller, engines, their nannies) has exited.
Forked start: ``Cluster.start()`` of 8 engines forked from one process that imported torch once
(``fork_engines=True``, the default on a Linux CPU machine) against the same start with every
engine its own Python process (``fork_engines=False``), alternated.
Replacement: an engine killed between calls, timed from the next ``Cluster.run`` to its result (a
new engine forked, registered, set up, every rank re-joined): forked by the cluster's running
zygote against the same after the zygote was killed, so that a new one imports torch again (what
every replacement cost before the zygote stayed), alternated.
Rejoin after a failure: a rank raises, and the next ``Cluster.run`` (every rank re-joins a fresh
torch.distributed world, then the no-op) is timed: rank 0's store socket bound and listening
before the other ranks are told its port (``reserve_port``) against a free port that rank 0 binds
only when it starts its store (as before), alternated on the same engines.
Round trip: ``Cluster.run`` of a function that does nothing on all 4 ranks (what every stepped
action pays on top of its compute), against ipyparallel's own ``apply_sync`` on the same engines;
target: mlmkit's round trip at most 50 ms.
Session step: ``Session.step()`` of the quickstart run (tp=2 x pp=2) from the notebook until its
metrics are back, one call to the engines (begin, actions, update, save of the finished step),
against the same step as three calls (begin; actions and update; save), as sessions stepped
before, alternated.
"""

from __future__ import annotations

import tempfile
import time

from benchmarks.common import Row, alternate, median, paired
from mlmkit import Topology
from mlmkit.cluster import Cluster
from mlmkit.cluster.cluster import alive


def _noop(*_args):
    return None


def _process_tree(pid=None) -> list[int]:
    """``pid`` (default: this process) and its descendants."""
    import os

    import psutil

    pid = os.getpid() if pid is None else pid
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def _until_gone(pids, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _replacements(reps: int) -> tuple[list[float], list[float]]:
    """Seconds to replace a killed engine: by the running zygote, and by a new one."""
    import os
    import signal

    import psutil

    warm, cold = [], []
    with Cluster(topology=Topology(tp=2, pp=2)) as cluster:
        for i in range(2 * reps):
            pid = cluster.info[i % 4]["pid"]
            fresh = (i % 4) in (1, 2)           # alternate which side runs first
            if fresh:
                os.kill(psutil.Process(pid).ppid(), signal.SIGKILL)     # its zygote: a new one must start
            os.kill(pid, signal.SIGKILL)
            _until_gone([pid])
            t0 = time.perf_counter()
            cluster.run(_noop)
            (cold if fresh else warm).append(time.perf_counter() - t0)
    return warm, cold


def _raise(*_args):
    raise RuntimeError("benchmark: a failing call")


def _port_found_not_held(_state, host="127.0.0.1"):
    # The rejoin as it was before reserve_port: a port free a moment ago, bound by rank 0's store later.
    from mlmkit.distributed import find_free_port

    return find_free_port(host)


def _rejoins(cluster, reps: int) -> tuple[list[float], list[float]]:
    """Seconds of the call after a failed one (its rejoin included): reserved port, port found only."""
    from mlmkit.cluster import RankError
    from mlmkit.cluster import cluster as cluster_module

    reserve = cluster_module.remote.reserve_port

    def after_failure(port_fn) -> float:
        cluster_module.remote.reserve_port = port_fn
        try:
            try:
                cluster.run(_raise, ranks=[3])
            except RankError:
                pass
            t0 = time.perf_counter()
            cluster.run(_noop)
            return time.perf_counter() - t0
        finally:
            cluster_module.remote.reserve_port = reserve

    return alternate(lambda: after_failure(reserve), lambda: after_failure(_port_found_not_held), reps)


def _session_steps(cluster, reps: int) -> tuple[list[float], list[float]]:
    """Seconds per ``Session.step()``, and per the same step made as three calls (as before)."""
    from mlmkit.cluster.session import _begin, _finish, _snapshot
    from mlmkit.train import demo_config

    session = cluster.session(demo_config())

    def one_call() -> float:
        t0 = time.perf_counter()
        session.step()
        return time.perf_counter() - t0

    def three_calls() -> float:
        t0 = time.perf_counter()
        session._call(_begin)
        session._call(_finish)
        session._call(_snapshot, *session._snapshot_args())
        return time.perf_counter() - t0

    try:
        return alternate(one_call, three_calls, reps)
    finally:
        session.close()


def run(quick: bool = False) -> list[Row]:
    import ipyparallel as ipp

    starts_ours, starts_plain, stops_ours, stops_plain = [], [], [], []
    session_steps = None
    for _ in range(1 if quick else 2):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            c = ipp.Cluster(n=4, profile_dir=d, controller_ip="127.0.0.1", log_level=40)
            rc = c.start_and_connect_sync(n=4)
            rc.wait_for_engines(4)
            starts_plain.append(time.perf_counter() - t0)
            pids = [p for tree in rc[:].apply_sync(_process_tree) for p in tree]
            pids += _process_tree(c.controller.process.pid)
            rc.close()
            t0 = time.perf_counter()
            c.stop_cluster_sync()
            _until_gone(pids)
            stops_plain.append(time.perf_counter() - t0)
        cluster = Cluster(topology=Topology(tp=2, pp=2))
        t0 = time.perf_counter()
        cluster.start()
        starts_ours.append(time.perf_counter() - t0)
        reps = 30 if quick else 100
        ours, plain = [], []
        view = cluster.client[cluster.engine_ids]
        for i in range(reps):
            t0 = time.perf_counter()
            cluster.run(_noop)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            view.apply_sync(_noop)
            plain.append(time.perf_counter() - t0)
        if not session_steps:
            session_steps = _session_steps(cluster, 8 if quick else 30)
            rejoins = _rejoins(cluster, 8 if quick else 30)
        pids = cluster.pids()
        t0 = time.perf_counter()
        cluster.shutdown()
        _until_gone(pids)
        stops_ours.append(time.perf_counter() - t0)
    warm, cold = _replacements(reps=2 if quick else 4)
    forked, own = [], []
    for _ in range(1 if quick else 2):
        for fork, times in ((True, forked), (False, own)):
            cluster = Cluster(topology=Topology(dp=8), fork_engines=fork)
            t0 = time.perf_counter()
            cluster.start()
            times.append(time.perf_counter() - t0)
            cluster.shutdown()
    o, b, ratio = paired(ours, plain)
    return [
        Row("cluster start (8 engines, gloo groups), forked engines", "fork_engines=True vs fork_engines=False",
            median(forked), median(own), "s", "n/a (reported)", None),
        Row("engine replacement (4 engines), until the next call returns",
            "fork by the running zygote vs a new zygote", median(warm), median(cold), "s", "n/a (reported)", None,
            ratio=paired(warm, cold)[2]),
        Row("cluster start (4 engines, gloo groups)", "Cluster.start vs ipyparallel start_and_connect",
            median(starts_ours), median(starts_plain), "s", "n/a (reported)", None),
        Row("cluster shutdown (4 engines), until every process exited",
            "Cluster.shutdown vs ipyparallel stop_cluster", median(stops_ours), median(stops_plain), "s",
            "n/a (reported)", None),
        Row("call after a failed one (4 engines), every rank re-joined", "store socket reserved before the "
            "ranks connect vs a free port bound when rank 0 starts its store, as before",
            median(rejoins[0]) * 1e3, median(rejoins[1]) * 1e3, "ms", "n/a (reported)", None,
            ratio=paired(*rejoins)[2]),
        Row("stepped-call round trip (4 engines)", "Cluster.run(no-op) vs view.apply_sync(no-op)",
            o * 1e3, b * 1e3, "ms", "mlmkit <= 50 ms", o * 1e3 <= 50, ratio=ratio),
        Row("session step (4 engines, quickstart tp=2 x pp=2), until its metrics are back",
            "one call (begin, actions, update, save) vs three, as before", median(session_steps[0]) * 1e3,
            median(session_steps[1]) * 1e3, "ms", "n/a (reported)", None, ratio=paired(*session_steps)[2]),
    ]
