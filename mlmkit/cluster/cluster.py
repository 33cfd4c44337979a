"""The notebook cluster: ipyparallel engines as ranks of a torch.distributed job.

::

    with Cluster(topology=Topology(tp=2, pp=2)) as cluster:   # 4 local engines, CPU + gloo
        cluster                                               # ranks, hosts, devices, the grid
        cluster.run(lambda r: r.groups.tp.ranks)               # {0: (0, 1), 1: (0, 1), ...}
        session = cluster.session(config)                     # interactive training

Start: an ipyparallel controller on 127.0.0.1 (unless a multi-node profile says otherwise) in a
private profile folder whose connection files are readable by their owner only; engines sorted by
host into ranks; one GPU per engine by local rank when CUDA exists, else CPU threads divided
between the engines of a host; ``torch.distributed`` initialised on a free port of rank 0's host
(retried on collision); process groups built from the Topology.

Failures never hang the notebook. Every call waits at most ``timeout_s``. When a rank raises, its
process groups are dropped at once (closing its connections), which frees peers blocked in a
collective with it; the error is raised in the notebook with the rank and its remote traceback
within a few seconds, after every rank re-joined a fresh ``torch.distributed`` world on a new port.
A rank still busy after ``grace_s`` (stuck) or whose engine died is killed and replaced by a new
engine before the error is raised, so the next cell works without a manual restart.

Shutdown destroys the process groups first (engines holding a live gloo group stop slowly), then
stops engines and controller, then checks by pid that none of their processes is left (and kills
any that is).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mlmkit.cluster import engine as remote
from mlmkit.topology import Topology

__all__ = ["Cluster", "EngineDied", "RankError", "RankTimeout", "alive"]

STATE = "mlmkit_rank"   # name of the EngineState in each engine's namespace


class RankError(RuntimeError):
    """A rank raised. ``rank``: which; ``remote_traceback``: its traceback; ``others``: later failures."""

    def __init__(self, rank: int, remote_traceback: str, *, others: Optional[dict] = None, note: str = ""):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others or {}
        super().__init__(f"rank {rank} raised{note}:\n{remote_traceback}")


class EngineDied(RankError):
    """The engine of ``rank`` died (killed, crashed). It has been replaced."""


class RankTimeout(RankError):
    """Ranks did not answer within the bound; they were killed and replaced."""


def _profile_source(profile: str) -> Optional[Path]:
    here = Path(__file__).resolve().parents[2] / "cluster" / f"profile_{profile}"
    return here if here.is_dir() else None


class Cluster:
    """Local (or profile-defined) ipyparallel engines, one rank each.

    Args:
        topology: the rank grid (default: ``n`` ranks of data parallelism).
        n: number of engines (default: ``topology.world_size``).
        profile: ``"local"`` (default), ``"slurm"`` or ``"mpi"``: a profile folder in ``cluster/``.
        timeout_s: bound on every call (default 60 s).
        collective_timeout_s: torch.distributed timeout of each rank's groups.
        grace_s: after a rank failed, how long the others get to finish before being killed.
        threads: torch threads per CPU engine (default: cores of the host / engines on it).
        backend: "gloo" or "nccl" (default: nccl with CUDA, else gloo).
    """

    def __init__(self, *, topology: Optional[Topology] = None, n: Optional[int] = None, profile: str = "local",
                 timeout_s: float = 60.0, collective_timeout_s: float = 30.0, grace_s: float = 2.0,
                 threads: Optional[int] = None, backend: Optional[str] = None, engine_start_timeout_s: float = 120.0):
        if topology is None:
            if n is None:
                raise ValueError("Cluster: give topology=Topology(...) or n=<number of engines>")
            topology = Topology(dp=n)
        if n is not None and n != topology.world_size:
            raise ValueError(f"Cluster: n={n} engines but {topology!r} needs {topology.world_size}")
        if timeout_s <= 0 or timeout_s > 3600:
            raise ValueError(f"Cluster: timeout_s={timeout_s} must be in (0, 3600]")
        self.topology, self.profile = topology, profile
        self.timeout_s, self.collective_timeout_s, self.grace_s = timeout_s, collective_timeout_s, grace_s
        self.threads, self.backend, self.engine_start_timeout_s = threads, backend, engine_start_timeout_s
        self.ipp_cluster = None
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []        # engine id of each rank
        self.info: list[dict] = []             # engine_info() of each rank
        self.setup: list[dict] = []
        self._profile_dir: Optional[str] = None
        self._all_pids: set[int] = set()
        self.start_time_s: Optional[float] = None
        self.master: Optional[tuple[str, int]] = None
        self.generation = 0                    # bumped whenever an engine is replaced
        self._dead_pids: dict[int, int] = {}   # pid of each rank's engine before its last replacement
        self._hostname = socket.gethostname()

    # ================================================================== lifecycle
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def running(self) -> bool:
        return self.client is not None

    def start(self) -> "Cluster":
        """Start controller and engines, make ranks of them, initialise torch.distributed."""
        import ipyparallel as ipp

        if self.running:
            return self
        t0 = time.perf_counter()
        self._profile_dir = tempfile.mkdtemp(prefix="mlmkit-ipp-")
        src = _profile_source(self.profile)
        if src is not None:
            shutil.copytree(src, self._profile_dir, dirs_exist_ok=True)
        elif self.profile != "local":
            raise ValueError(f"Cluster: no profile folder cluster/profile_{self.profile}")
        kwargs = dict(n=self.world_size, profile_dir=self._profile_dir, log_level=40, shutdown_atexit=True)
        if self.profile == "local":
            kwargs["controller_ip"] = "127.0.0.1"
        self.ipp_cluster = ipp.Cluster(**kwargs)
        try:
            self.client = self.ipp_cluster.start_and_connect_sync(n=self.world_size)
            self.client.wait_for_engines(self.world_size, timeout=self.engine_start_timeout_s)
            self._secure_connection_files()
            self._assign_ranks(sorted(self.client.ids))
            self._connect_all()
        except BaseException:
            self.shutdown()
            raise
        self.start_time_s = time.perf_counter() - t0
        self._start_reaper()
        return self

    def _start_reaper(self) -> None:
        # A separate watchdog kills controller and engines if this kernel dies abruptly.
        import subprocess
        import sys

        pids = sorted(self.pids())
        self._reaper = subprocess.Popen([sys.executable, "-m", "mlmkit.cluster.reaper", str(os.getpid()),
                                         *map(str, pids)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    @classmethod
    def attach(cls, connection_file: str, *, topology: Topology, **kwargs) -> "Cluster":
        """Use engines that something else started (e.g. a Slurm job, see cluster/README.md).

        ``connection_file`` is the controller's ``ipcontroller-client.json``. The engines become
        ranks as with :meth:`start`; :meth:`shutdown` drops the process groups and disconnects but
        leaves the engines to the job that owns them. A dead engine cannot be replaced from here.
        """
        import ipyparallel as ipp

        self = cls(topology=topology, **kwargs)
        t0 = time.perf_counter()
        self.client = ipp.Client(connection_file)
        self.client.wait_for_engines(self.world_size, timeout=self.engine_start_timeout_s)
        self._attached = True
        self._assign_ranks(sorted(self.client.ids)[: self.world_size])
        self._connect_all()
        self.start_time_s = time.perf_counter() - t0
        return self

    def _secure_connection_files(self) -> None:
        sec = Path(self._profile_dir) / "security"
        for f in sec.glob("*.json"):
            f.chmod(stat.S_IRUSR | stat.S_IWUSR)
        if self.ipp_cluster.cluster_file and os.path.exists(self.ipp_cluster.cluster_file):
            os.chmod(self.ipp_cluster.cluster_file, stat.S_IRUSR | stat.S_IWUSR)

    def _assign_ranks(self, engine_ids: Sequence[int]) -> None:
        infos = self.client[list(engine_ids)].apply_sync(remote.engine_info)
        order = sorted(zip(engine_ids, infos), key=lambda e: (e[1]["host"], e[0]))
        self.engine_ids = [eid for eid, _ in order]
        self.info = [inf for _, inf in order]
        for inf in self.info:
            self._all_pids.update([inf["pid"], *inf["children"]])
        self.view = self.client[self.engine_ids]
        self.view.block = False
        self._setup_ranks(range(self.world_size))

    def _setup_ranks(self, ranks) -> None:
        hosts = [inf["host"] for inf in self.info]
        per_host = Counter(hosts)
        seen: Counter = Counter()
        local = []
        for h in hosts:
            local.append(seen[h])
            seen[h] += 1
        results = {}
        import sys

        # Engines import what the driver can: functions of the notebook's own modules (and of test
        # files) are shipped by reference and must resolve there too.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        for r in ranks:
            v = self.client[self.engine_ids[r]]
            v.execute(f"import sys as _sys; _sys.path[:0] = [p for p in {paths!r} if p not in _sys.path]; "
                      f"import torch; from mlmkit.cluster.engine import EngineState as _S; {STATE} = _S(); "
                      f"rank = {r}", block=True)
            threads = self.threads or max(1, (self.info[r]["cpus"] or 1) // per_host[hosts[r]])
            results[r] = v.apply_async(
                _setup_remote, _ref(), rank=r, world_size=self.world_size, topology=self.topology,
                local_rank=local[r], threads=threads, backend=self.backend, timeout_s=self.collective_timeout_s,
                driver_pid=os.getpid() if self._is_local(r) else None)
        for r, ar in results.items():
            out = ar.get(timeout=self.timeout_s)
            if r < len(self.setup):
                self.setup[r] = out
            else:
                self.setup.append(out)

    def _is_local(self, rank: int) -> bool:
        # Called in the polling loop of every wait: compare against a hostname read once.
        return self.info[rank]["host"] == self._hostname

    def _connect_all(self, attempts: int = 4) -> None:
        """(Re)join every rank to a fresh torch.distributed world on a new free port."""
        last = None
        for _ in range(attempts):
            master_host = "127.0.0.1" if self._is_local(0) else self._raw(0, remote.host_address)
            port = self._raw(0, remote.free_port)
            pending = {r: self.client[self.engine_ids[r]].apply_async(_connect_remote, _ref(), master_host, port)
                       for r in range(self.world_size)}
            try:
                self._wait(pending, timeout_s=self.timeout_s, recover=False)
                self.master = (master_host, port)
                return
            except RankError as err:
                last = err
                if "address already in use" not in err.remote_traceback.lower():
                    raise
        raise last

    def _raw(self, rank: int, fn: Callable, *args):
        return self.client[self.engine_ids[rank]].apply_async(fn, _ref(), *args).get(timeout=self.timeout_s)

    def shutdown(self) -> list[int]:
        """Destroy process groups, stop engines and controller, and make sure no process is left.

        Returns the pids that had to be killed by force (normally none).
        """
        if self.ipp_cluster is None and not getattr(self, "_attached", False):
            return []
        if self.client is not None and self.engine_ids:
            try:
                ars = [self.client[e].apply_async(remote.shutdown, _ref()) for e in self.engine_ids
                       if e in self.client.ids]
                for ar in ars:
                    ar.wait(timeout=5)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if getattr(self, "_attached", False):
            self.client.close()
            self.client = self.view = None
            return []
        pids = set(self._all_pids)
        ctrl = getattr(self.ipp_cluster, "controller", None)
        if ctrl is not None and getattr(ctrl, "process", None) is not None:
            pids.add(ctrl.process.pid)
            pids.update(_children(ctrl.process.pid))
        try:
            if self.client is not None:
                self.client.close()
            self.ipp_cluster.stop_cluster_sync()
        except Exception:  # noqa: BLE001
            pass
        killed = _reap(pids, wait_s=10.0)
        reaper = getattr(self, "_reaper", None)
        if reaper is not None:
            reaper.kill()
            reaper.wait(timeout=5)
        self.client = self.view = self.ipp_cluster = None
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        self._last_pids = pids
        return killed

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def pids(self) -> set[int]:
        """Every process of this cluster: engines, their nannies, the controller and its schedulers."""
        pids = set(self._all_pids)
        ctrl = getattr(self.ipp_cluster, "controller", None) if self.ipp_cluster else None
        if ctrl is not None and getattr(ctrl, "process", None) is not None:
            pids.add(ctrl.process.pid)
            pids.update(_children(ctrl.process.pid))
        return pids

    # ================================================================== running code
    def run(self, fn: Callable[..., Any], *args, ranks: Optional[Sequence[int]] = None,
            timeout_s: Optional[float] = None, **kwargs) -> dict[int, Any]:
        """Run ``fn(rank_state, *args, **kwargs)`` on the given ranks (default: all); results by rank.

        ``rank_state`` is the engine's :class:`~mlmkit.cluster.engine.EngineState` (``.rank``,
        ``.groups``, ``.device``, ``.trainer``, ``.data``). A function defined in the notebook is
        shipped by value and its global names resolve in the engine's namespace, where ``torch``
        is already imported: import anything else inside the function. Functions of importable
        modules are shipped by reference. Raises :class:`RankError` and friends.
        """
        if not self.running:
            raise RuntimeError("Cluster is not running: call start() or use `with Cluster(...) as cluster:`")
        self.ensure_healthy()
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        for r in ranks:
            self.topology._check_rank(r)
        pending = {r: self.client[self.engine_ids[r]].apply_async(remote.call, _ref(), fn, args, kwargs)
                   for r in ranks}
        return self._wait(pending, timeout_s=timeout_s or self.timeout_s)

    def run_frame(self, fn: Callable[..., Any], *args, **kwargs):
        """Like :meth:`run`, as a DataFrame: DataFrame results are concatenated, others become rows."""
        import pandas as pd

        results = self.run(fn, *args, **kwargs)
        values = [results[r] for r in sorted(results)]
        if values and all(isinstance(v, pd.DataFrame) for v in values):
            return pd.concat(values, ignore_index=True)
        rows = []
        for r, v in sorted(results.items()):
            rows.append({"rank": r, **(v if isinstance(v, dict) else {"result": v})})
        return pd.DataFrame(rows).set_index("rank")

    def ensure_healthy(self) -> list[int]:
        """Replace engines that vanished since the last call (e.g. killed between cells).

        Returns the ranks that got new engines (and bumps :attr:`generation`)."""
        ids = set(self.client.ids)
        gone = [r for r in range(self.world_size) if self.engine_ids[r] not in ids or not self._engine_alive(r)]
        if gone:
            self._recover(dead=gone, stuck=[])
        return gone

    def activate(self, suffix: str = "") -> None:
        """Register ``%px``/``%%px`` magics on this cluster's engines (in rank order)."""
        view = self.client[self.engine_ids]
        view.block = True
        view.activate(suffix)

    # ================================================================== waiting and failures
    def _engine_alive(self, rank: int) -> bool:
        if not self._is_local(rank):
            return True  # remote hosts: ipyparallel reports the death itself
        try:
            os.kill(self.info[rank]["pid"], 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _wait(self, pending: dict, *, timeout_s: float, recover: bool = True) -> dict[int, Any]:
        """Results of ``pending`` (rank -> AsyncResult), or a RankError after recovery."""
        from ipyparallel.error import RemoteError

        deadline = time.monotonic() + timeout_s
        results, failures, dead = {}, {}, set()
        first_failure_at = None
        while len(results) + len(failures) + len(dead) < len(pending):
            now = time.monotonic()
            for r, ar in pending.items():
                if r in results or r in failures or r in dead:
                    continue
                if ar.ready():
                    try:
                        results[r] = ar.get(0)
                    except Exception as err:  # noqa: BLE001 - RemoteError, or EngineError when it died
                        if type(err).__name__ == "EngineError" or not self._engine_alive(r):
                            dead.add(r)
                        elif isinstance(err, RemoteError):
                            failures[r] = (time.monotonic(), _remote_text(err))
                        else:
                            failures[r] = (time.monotonic(), f"{type(err).__name__}: {err}")
                elif not self._engine_alive(r):
                    dead.add(r)
            if (failures or dead) and first_failure_at is None:
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > self.grace_s:
                break
            if now > deadline:
                break
            time.sleep(0.005)
        stuck = [r for r in pending if r not in results and r not in failures and r not in dead]
        if not failures and not dead and not stuck:
            return {r: results[r] for r in pending}  # in the order asked (rank order by default)
        if not recover:
            r = min(failures, key=lambda k: failures[k][0]) if failures else (sorted(dead) or stuck)[0]
            raise RankError(r, failures[r][1] if r in failures else "no answer")
        replaced = self._recover(dead=sorted(dead), stuck=stuck)
        dead |= set(replaced) - set(stuck)
        note = f" (ranks {replaced} got new engines)" if replaced else ""
        others = {r: tb for r, (_, tb) in failures.items()}
        if dead:
            r = sorted(dead)[0]
            raise EngineDied(r, f"the engine of rank {r} (pid {self._old_pid(r)}) died", others=others, note=note)
        if failures:
            r = _root_cause(failures)
            others.pop(r, None)
            raise RankError(r, failures[r][1], others=others, note=note)
        raise RankTimeout(stuck[0], f"ranks {stuck} did not finish within {timeout_s:g} s", note=note)

    def _old_pid(self, rank: int) -> int:
        return self._dead_pids.get(rank, self.info[rank]["pid"])

    def _recover(self, *, dead: list[int], stuck: list[int]) -> list[int]:
        """Kill stuck engines, replace dead and killed ones, and re-join every rank on a new port."""
        self._dead_pids = {}
        time.sleep(0.2)  # let a dying engine's registration go before checking who is left
        ids = set(self.client.ids)
        vanished = {r for r in range(self.world_size) if self.engine_ids[r] not in ids or not self._engine_alive(r)}
        replace = sorted(set(dead) | set(stuck) | vanished)
        for r in replace:
            self._dead_pids[r] = self.info[r]["pid"]
            if self._is_local(r):
                _reap({self.info[r]["pid"], *self.info[r]["children"]}, wait_s=0.0)
        if replace:
            self._replace_engines(replace)
        self._connect_all()
        return replace

    def _replace_engines(self, ranks: list[int]) -> None:
        if self.ipp_cluster is None:
            raise RuntimeError(f"the engines of ranks {ranks} are gone and this cluster was attached, not started "
                               f"here: restart the job that runs the engines, then attach again")
        before = set(self.client.ids)
        self.ipp_cluster.start_engines_sync(n=len(ranks))
        deadline = time.monotonic() + self.engine_start_timeout_s
        while len(set(self.client.ids) - before) < len(ranks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replacement engines for ranks {ranks} did not start in {self.engine_start_timeout_s} s")
            time.sleep(0.1)
        new = sorted(set(self.client.ids) - before)[: len(ranks)]
        self.generation += 1
        infos = self.client[new].apply_sync(remote.engine_info)
        for r, eid, inf in zip(ranks, new, infos):
            self.engine_ids[r] = eid
            self.info[r] = inf
            self._all_pids.update([inf["pid"], *inf["children"]])
        self.view = self.client[self.engine_ids]
        self.view.block = False
        self._setup_ranks(ranks)

    # ================================================================== display
    def to_frame(self):
        """One row per rank: host, pid, device, threads and grid coordinates."""
        import pandas as pd

        rows = []
        for r in range(self.world_size):
            c = self.topology.coords(r)
            rows.append({"rank": r, "engine": self.engine_ids[r] if self.engine_ids else None,
                         "host": self.info[r]["host"] if self.info else None,
                         "pid": self.info[r]["pid"] if self.info else None,
                         "device": self.setup[r]["device"] if r < len(self.setup) else None,
                         "threads": self.setup[r]["threads"] if r < len(self.setup) else None,
                         "tp": c.tp, "dp": c.dp, "pp": c.pp})
        return pd.DataFrame(rows).set_index("rank")

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        master = f", master={self.master[0]}:{self.master[1]}" if self.master and self.running else ""
        return f"Cluster({self.topology!r}, profile={self.profile!r}, {state}{master})"

    def _repr_html_(self) -> str:
        if not self.running:
            return f"<b>{self!r}</b>"
        return f"<b>{self!r}</b>" + self.to_frame()._repr_html_() + f"<pre>{self.topology.grid()}</pre>"

    # ================================================================== sessions
    def session(self, config, **kwargs):
        """An interactive training :class:`~mlmkit.cluster.session.Session` on these ranks."""
        from mlmkit.cluster.session import Session

        return Session(self, config, **kwargs)


# ------------------------------------------------------------------------------------ helpers
def _ref():
    import ipyparallel as ipp

    return ipp.Reference(STATE)


def _setup_remote(state, **kw):
    return state.setup(**kw)


def _connect_remote(state, master, port):
    return remote.call(state, lambda s: s.connect(master=master, port=port), (), {})


def _remote_text(err) -> str:
    tb = getattr(err, "traceback", None)
    text = tb if isinstance(tb, str) and tb else str(err)
    # RemoteFailure already carries the original traceback: keep that part only.
    marker = "RemoteFailure: rank"
    if marker in text:
        text = text[text.index(marker) + len("RemoteFailure: "):]
        text = text.split("\n", 1)[1] if "\n" in text else text
    return text.strip()


_CONSEQUENCE_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "timed out",
                        "gloo", "process group", "remote worker", "not initialized", "default process group")


def _consequence(tb: str) -> bool:
    low = tb.lower()
    return any(m in low for m in _CONSEQUENCE_MARKERS)


def _root_cause(failures: dict) -> int:
    """Among several failed ranks, the one whose error is not a consequence of a lost peer."""
    causes = [r for r, (_, tb) in failures.items() if not _consequence(tb.splitlines()[-1] if tb else "")]
    pool = causes or list(failures)
    return min(pool, key=lambda r: (failures[r][0], r))


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _reap(pids, *, wait_s: float) -> list[int]:
    """Wait up to ``wait_s`` for ``pids`` to exit, then SIGKILL the rest; return the killed ones."""
    import psutil

    deadline = time.monotonic() + wait_s
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    killed = []
    for p in alive:
        try:
            proc = psutil.Process(p)
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                killed.append(p)
        except psutil.Error:
            pass
    time.sleep(0.05 if killed else 0.0)
    for p in pids:  # collect our own exited children, so no zombie is left behind
        try:
            os.waitpid(p, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    return killed


def alive(pids) -> list[int]:
    """The pids among ``pids`` that still exist as processes (zombies excluded)."""
    return [p for p in pids if _running(p)]


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
