"""The notebook cluster: ipyparallel engines as ranks of a torch.distributed job.

::

    with Cluster(topology=Topology(tp=2, pp=2)) as cluster:   # 4 local engines, CPU + gloo
        cluster                                               # ranks, hosts, devices, the grid
        cluster.run(lambda r: r.groups.tp.ranks)               # {0: (0, 1), 1: (0, 1), ...}
        session = cluster.session(config)                     # interactive training

Start: an ipyparallel controller on 127.0.0.1 (unless a multi-node profile says otherwise) in a
private profile folder (mode 0700; connection files 0600) that is removed at shutdown, at the
driver's exit, or by a watchdog process if the driver is killed; engines sorted by host into
ranks; one GPU per engine by local rank when CUDA exists, else CPU threads divided between the
engines of a host; ``torch.distributed`` initialised on a free port of rank 0's host (retried on
collision), its rendezvous store and gloo's connections bound to 127.0.0.1 for a local cluster;
process groups built from the Topology.

Failures never hang the notebook, and an error arrives promptly; repairs happen at the next call.

- A rank raises: it abandons its step and drops its process groups at once (closing its
  connections), which frees peers blocked in a collective or a receive with it; the error is
  raised with the rank and its remote traceback within a few seconds. No engine is replaced:
  the next call re-joins every rank to a fresh ``torch.distributed`` world on a new port. A peer
  that the failure does not free within ``grace_s`` (busy outside communication, or blocked on
  such a rank) dumps its Python stack and is killed: the error names it with where it was
  (``unreleased``), and its engine is replaced at the next call.
- A rank does not finish within ``timeout_s``: every unfinished local rank dumps its Python stack;
  ranks that are not blocked in communication (the stuck ones) are killed first, which frees the
  ranks blocked on them; anything still running a moment later is killed too. :class:`RankTimeout`
  names the stuck ranks with their stacks. Killed engines are replaced at the next call.
- An engine dies: :class:`EngineDied` names it; it is replaced at the next call.
- Ctrl-C while waiting: the busy engines get SIGINT (their Python code stops and aborts, which
  frees their peers); engines still busy after ``grace_s`` are killed and replaced at the next call.

Shutdown destroys the process groups first (engines holding a live gloo group stop slowly), then
stops engines and controller, then checks by pid that none of their processes is left (and kills
any that is), and removes the private folder.
"""

from __future__ import annotations

import atexit
import numbers
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mlmkit.cluster import engine as remote
from mlmkit.cluster.reaper import start_token, write_pids
from mlmkit.distributed.launch import MAX_LOCAL_RANKS, RANK_BYTES, local_gpus, max_local_ranks
from mlmkit.topology import Topology

__all__ = ["Cluster", "EngineDied", "RankError", "RankTimeout", "alive", "max_local_engines"]

#: Clusters this process started and has not shut down (a process-wide resource list: a notebook
#: that re-runs its cluster cell must not leave the first engines running unreachable).
_STARTED: set = set()

STATE = "mlmkit_rank"   # name of the EngineState in each engine's namespace
#: Memory one CPU engine takes with torch imported, and the most local CPU engines whatever the
#: memory: a CPU rank's, as for :func:`mlmkit.distributed.run_ranks`.
ENGINE_BYTES, MAX_LOCAL_ENGINES = RANK_BYTES, MAX_LOCAL_RANKS


def _where(rank: int, stack: str, label: str = "") -> str:
    return f"--- rank {rank}{label} was at:\n{stack or '(no stack: engine on another host)'}"


class RankError(RuntimeError):
    """A rank raised. ``rank``: which; ``remote_traceback``: its traceback; ``others``: later failures;
    ``unreleased``: peers that the failure did not free within ``grace_s`` (rank -> where its Python
    stack was), killed (their engines are replaced at the next call)."""

    what = "raised"

    def __init__(self, rank: int, remote_traceback: str, *, others: Optional[dict] = None, note: str = "",
                 unreleased: Optional[dict] = None):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others or {}
        self.unreleased = unreleased or {}
        where = "".join("\n" + _where(q, stack, " (not freed by the failure within grace_s: killed)")
                        for q, stack in sorted(self.unreleased.items()))
        super().__init__(f"rank {rank} {self.what}{note}:\n{remote_traceback}{where}")


class EngineDied(RankError):
    """The engine of ``rank`` died (killed, crashed). It is replaced at the next call."""

    what = "died"


class RankTimeout(RankError):
    """``rank`` (and ``ranks``) did not finish within the bound; ``stacks`` tells where they were.
    They were killed; their engines are replaced at the next call."""

    what = "did not finish"

    def __init__(self, rank: int, remote_traceback: str, *, ranks: Sequence[int] = (), stacks: Optional[dict] = None,
                 note: str = ""):
        self.ranks, self.stacks = list(ranks) or [rank], stacks or {}
        super().__init__(rank, remote_traceback, note=note)


def _profile_source(profile: str) -> Optional[Path]:
    here = Path(__file__).resolve().parents[2] / "cluster" / f"profile_{profile}"
    return here if here.is_dir() else None


def max_local_engines() -> int:
    """How many CPU engines this machine can hold (:func:`mlmkit.distributed.launch.max_local_ranks`:
    its available memory / :data:`ENGINE_BYTES`, at most :data:`MAX_LOCAL_ENGINES`)."""
    return max_local_ranks()


#: The longest a wait sleeps before it looks again (a reply wakes it at once), and how often it
#: checks that the engines it waits for are alive (a killed engine sends no reply).
POLL_S, LIVENESS_S = 0.02, 0.05


class _RunningClock:
    """Seconds of waiting that this process was running for, from its creation.

    A virtual machine can stall for seconds (its host runs other machines): every process stops,
    the wall clock does not. Waited by the wall clock, a grace given to peers to release each other
    would run out during the stall, and healthy engines that had no chance to run would be killed.
    Each :meth:`elapsed` adds the time since the last look, at most ``cap_s``: a driver that looks
    every few milliseconds counts the wall clock, a stall counts ``cap_s``."""

    def __init__(self, cap_s: float = 0.25):
        self.cap_s, self.last, self.total = cap_s, time.monotonic(), 0.0

    def elapsed(self) -> float:
        now = time.monotonic()
        self.total += min(max(0.0, now - self.last), self.cap_s)
        self.last = now
        return self.total


def _check_seconds(name: str, value: object, *, allow_zero: bool = False, upper: float = 24 * 3600) -> float:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and value == value
    if not ok or value < 0 or (value == 0 and not allow_zero) or value > upper:
        low = "0 <=" if allow_zero else "0 <"
        raise ValueError(f"Cluster: {name}={value!r} must be a number of seconds with {low} {name} <= {upper:g}")
    return float(value)


def _is_loopback_address(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def _open_mpi_major() -> Optional[int]:
    """Open MPI's major version from ``mpiexec --version``, or None for another MPI."""
    import re
    import subprocess

    try:
        text = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\((?:Open MPI|OpenRTE)\) (\d+)\.", text)
    return int(m.group(1)) if m else None


def _check_mpi(mpi_args: list) -> None:
    """Fail before anything starts when the MPI profile cannot: no mpiexec, no mpi4py (the engines
    register through MPI), or Open MPI run as root without its opt-in."""
    import shutil as _shutil

    if _shutil.which("mpiexec") is None:
        raise ValueError("Cluster(profile='mpi'): no mpiexec on PATH; install an MPI (Debian/Ubuntu: apt-get install "
                         "openmpi-bin libopenmpi-dev; conda: conda install -c conda-forge openmpi mpi4py)")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise ValueError("Cluster(profile='mpi'): mpi4py is not installed; pip install 'mlmkit[mpi]' (or pip install "
                         "mpi4py) in the environment the engines use") from None
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-run-as-root" not in mpi_args:
        opted_in = (os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1"
                    and os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1")
        if _open_mpi_major() is not None and not opted_in:
            raise ValueError("Cluster(profile='mpi'): Open MPI's mpiexec refuses to run as root; run as a normal user, "
                             "or opt in with scheduler_args=['--allow-run-as-root'] (or the environment variables "
                             "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)")


class Cluster:
    """Local (or profile-defined) ipyparallel engines, one rank each.

    Args:
        topology: the rank grid (default: ``n`` ranks of data parallelism).
        n: number of engines (default: ``topology.world_size``).
        profile: ``"local"`` (default), ``"slurm"`` or ``"mpi"``: a profile folder in ``cluster/``.
        timeout_s: bound on every call (default 60 s).
        collective_timeout_s: torch.distributed timeout of each rank's groups.
        grace_s: after a rank failed (or Ctrl-C), how long the others get to finish before being killed
            (time this driver runs: a stall of the whole virtual machine does not use it up).
        threads: torch threads per CPU engine (default: cores of the host / engines on it).
        backend: "gloo" (CPU engines, also on a machine with GPUs) or "nccl" (a GPU per engine);
            default: nccl with CUDA, else gloo.
        engine_start_timeout_s: bound on starting the engines (their registration, torch's import and
            each rank's setup; also for replacement engines).
        scheduler_args: options for the engines' launcher: ``sbatch`` options with
            ``profile="slurm"`` (e.g. ``["--partition=gpu", "--gpus-per-task=1", "--time=1:00:00"]``),
            ``mpiexec`` options with ``profile="mpi"`` (e.g. ``["--hostfile", "hosts.txt"]``).
        fork_engines: start the engines by forking them from one process that imported torch once
            (:mod:`mlmkit.cluster.zygote`) instead of starting each as a new Python that imports it
            again: 8 engines start in about a quarter of the time on 2 cores, and an engine that
            died is replaced by a fork of the same process in about a second. Default: on Linux for
            a local CPU cluster (with CUDA each engine starts as its own process). Only for ``"local"``.
        controller_ip: where the controller listens. Default: 127.0.0.1 for ``"local"``; for
            ``"slurm"`` and ``"mpi"`` this host's routable address (engines on other nodes connect
            to it; never every interface). Give ``"127.0.0.1"`` when the engines run on this host.

    Bad values raise ValueError here, before any process starts (for ``"mpi"``: mpiexec or mpi4py
    missing, or Open MPI run as root without its opt-in, with the fix named).
    """

    def __init__(self, *, topology: Optional[Topology] = None, n: Optional[int] = None, profile: str = "local",
                 timeout_s: float = 60.0, collective_timeout_s: float = 30.0, grace_s: float = 2.0,
                 threads: Optional[int] = None, backend: Optional[str] = None, engine_start_timeout_s: float = 120.0,
                 scheduler_args: Sequence[str] = (), controller_ip: Optional[str] = None,
                 fork_engines: Optional[bool] = None):
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            raise ValueError(f"Cluster: n={n!r} must be an integer >= 1 (the number of engines)")
        if topology is None:
            if n is None:
                raise ValueError("Cluster: give topology=Topology(...) or n=<number of engines>")
            topology = Topology(dp=n)
        if not isinstance(topology, Topology):
            raise ValueError(f"Cluster: topology={topology!r} must be a mlmkit.Topology")
        if n is not None and n != topology.world_size:
            raise ValueError(f"Cluster: n={n} engines but {topology!r} needs {topology.world_size}")
        self.timeout_s = _check_seconds("timeout_s", timeout_s, upper=3600)
        self.collective_timeout_s = _check_seconds("collective_timeout_s", collective_timeout_s)
        self.grace_s = _check_seconds("grace_s", grace_s, allow_zero=True, upper=3600)
        self.engine_start_timeout_s = _check_seconds("engine_start_timeout_s", engine_start_timeout_s)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1):
            raise ValueError(f"Cluster: threads={threads!r} must be an integer >= 1 (or None: cores / engines)")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"Cluster: backend={backend!r} is not a torch.distributed backend mlmkit uses; "
                             f"choose 'gloo' (CPU), 'nccl' (one GPU per engine) or None (nccl when CUDA exists)")
        if not isinstance(profile, str) or (profile != "local" and _profile_source(profile) is None):
            raise ValueError(f"Cluster: no profile folder cluster/profile_{profile} (profiles: local, slurm, mpi)")
        if isinstance(scheduler_args, str) or not all(isinstance(a, str) for a in scheduler_args):
            raise ValueError(f"Cluster: scheduler_args={scheduler_args!r} must be a list of strings, one option each "
                             f"(e.g. ['--partition=gpu', '--time=1:00:00'])")
        if scheduler_args and profile == "local":
            raise ValueError("Cluster: scheduler_args are options for sbatch (profile='slurm') or mpiexec "
                             "(profile='mpi'); a local cluster has no scheduler")
        if fork_engines not in (None, True, False):
            raise ValueError(f"Cluster: fork_engines={fork_engines!r} must be True, False or None (forked on Linux "
                             f"for a local CPU cluster)")
        if fork_engines and (profile != "local" or not sys.platform.startswith("linux")):
            raise ValueError(f"Cluster: fork_engines=True forks the engines on this host and needs Linux and "
                             f"profile='local' (here {sys.platform!r}, profile={profile!r}); leave it None")
        cuda = False
        if profile == "local":
            cuda, backend = self._check_local_capacity(topology.world_size, backend)
        self.fork_engines = (profile == "local" and sys.platform.startswith("linux") and not cuda
                             if fork_engines is None else fork_engines)
        if profile == "mpi":
            _check_mpi(list(scheduler_args))
        self.scheduler_args = list(scheduler_args)
        self.controller_ip = controller_ip
        self.topology, self.profile = topology, profile
        self.threads, self.backend = threads, backend
        self.ipp_cluster = None
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []        # engine id of each rank
        self.info: list[dict] = []             # engine_info() of each rank
        self.setup: list[dict] = []
        self._profile_dir: Optional[str] = None
        self._attached = False
        self._all_pids: set[int] = set()
        self.start_time_s: Optional[float] = None
        self.master: Optional[tuple[str, int]] = None
        self.generation = 0                    # bumped whenever an engine is replaced
        #: (session id, weak reference) of the session whose step is in progress on the engines, if any
        #: (:class:`~mlmkit.cluster.session.Session`: one step at a time per cluster).
        self._midstep = None
        #: Sessions whose trainers live on the engines, by id (weak: a dropped session's trainers are
        #: closed by the next session, see Session._claim_cluster).
        self._sessions = weakref.WeakValueDictionary()
        self._session_ids: set[str] = set()
        self._broken = False                   # process groups must be rebuilt before the next call
        self._doomed: set[int] = set()         # ranks whose engines were killed: replaced at the next call
        self._hostname = socket.gethostname()
        self._reaper = None

    @staticmethod
    def _check_local_capacity(n: int, backend: Optional[str]) -> tuple[bool, Optional[str]]:
        """Check that this machine can run ``n`` local engines: whether they use CUDA, and the
        backend. ``None`` with fewer GPUs than engines: gloo engines on the CPU (a warning says so;
        a laptop's one GPU does not stop the notebooks' 4-rank clusters)."""
        import warnings

        gpus = local_gpus()
        if backend is None and 0 < gpus < n:
            warnings.warn(f"Cluster: {n} engines and {gpus} GPU(s) here: the engines run on the CPU with gloo "
                          f"(backend='nccl' requires a GPU per engine: at most {gpus} ranks)", stacklevel=3)
            backend = "gloo"
        cuda = gpus > 0 and backend != "gloo"
        if cuda and n > gpus:
            raise ValueError(
                f"Cluster: {n} engines but this machine has {gpus} GPU(s); each engine takes one GPU with "
                f"backend='nccl'. Use a topology of at most {gpus} ranks, or backend='gloo' (or None) to run "
                f"the ranks on the CPU.")
        if backend == "nccl" and not gpus:
            raise ValueError("Cluster: backend='nccl' needs CUDA, which this machine does not have; use "
                             "backend='gloo' (or None: gloo without CUDA)")
        if not cuda:
            limit = max_local_engines()
            if n > limit:
                raise ValueError(
                    f"Cluster: n={n} engines is more than this machine can run: each CPU engine takes about "
                    f"{ENGINE_BYTES / 2**30:.1f} GiB with torch loaded, and the available memory holds {limit}. "
                    f"Use a topology of at most {limit} ranks, or a multi-node profile (profile='slurm').")
        return cuda, backend

    # ================================================================== lifecycle
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def private_dir(self) -> Optional[str]:
        """This cluster's private folder (mode 0700), removed at shutdown; ``None`` when attached."""
        return self._profile_dir

    def start(self) -> "Cluster":
        """Start controller and engines, make ranks of them, initialise torch.distributed."""
        import ipyparallel as ipp

        if self.running:
            return self
        for other in list(_STARTED):
            # Re-running a notebook cell would start a second set of engines beside the first, which
            # nobody can reach any more: the earlier cluster of the same grid and profile is stopped.
            if other is not self and other.running and other.topology == self.topology and other.profile == self.profile:
                print(f"mlmkit: stopping the {other.world_size}-engine cluster ({other.topology!r}, profile "
                      f"{other.profile!r}) started earlier in this process before starting a new one; keep one "
                      f"Cluster per grid, or use `with Cluster(...) as cluster:`", flush=True)
                other.shutdown()
        t0 = time.perf_counter()
        self._profile_dir = tempfile.mkdtemp(prefix="mlmkit-ipp-")
        _finalizer = weakref.finalize(self, shutil.rmtree, self._profile_dir, True)
        atexit.register(_finalizer)   # removed at exit even without shutdown()
        src = _profile_source(self.profile)
        if src is not None:
            shutil.copytree(src, self._profile_dir, dirs_exist_ok=True)
        os.chmod(self._profile_dir, stat.S_IRWXU)        # copytree copied the source folder's mode
        os.makedirs(os.path.join(self._profile_dir, "stacks"), mode=0o700, exist_ok=True)
        kwargs = dict(n=self.world_size, profile_dir=self._profile_dir, log_level=40, shutdown_atexit=True,
                      controller_ip=self._controller_address(), config=self._launcher_config())
        if self.profile in ("slurm", "mpi") or self.fork_engines:
            from mlmkit.cluster import launchers

            kwargs["engine_launcher_class"] = {"slurm": launchers.PrivateSlurmEngineSetLauncher,
                                               "mpi": launchers.PrivateMPIEngineSetLauncher,
                                               "local": launchers.ForkedEngineSetLauncher}[self.profile]
        if self.fork_engines:
            # ipyparallel waits 1 s between starting the controller and the engines; the zygote's
            # imports take longer, and it forks once the controller's connection file is whole.
            kwargs["delay"] = 0.0
        self.ipp_cluster = ipp.Cluster(**kwargs)
        try:
            self.client = self.ipp_cluster.start_and_connect_sync(n=self.world_size)
            self.client.wait_for_engines(self.world_size, timeout=self.engine_start_timeout_s)
            self._secure_connection_files()
            self._assign_ranks(sorted(self.client.ids))
            self._start_reaper()
            self._connect_all()
        except KeyboardInterrupt:
            self.shutdown()
            raise
        except Exception as err:
            logs = self._log_tails()       # read before shutdown removes the private folder
            self.shutdown()
            if isinstance(err, (RankError, ValueError)):
                raise
            raise RuntimeError(f"Cluster(profile={self.profile!r}): the engines did not start: "
                               f"{type(err).__name__}: {err}" + (f"\n{logs}" if logs else "")) from None
        self.start_time_s = time.perf_counter() - t0
        _STARTED.add(self)
        return self

    def _controller_address(self) -> str:
        if self.controller_ip:
            return self.controller_ip
        if self.profile == "local":
            return "127.0.0.1"
        from mlmkit.distributed.rendezvous import routable_address

        return routable_address()

    def _launcher_config(self):
        """Launcher settings: job files and logs in the private folder, the scheduler's options."""
        from traitlets.config import Config

        cfg = Config()
        cfg.ForkedEngineSetLauncher.start_timeout = float(self.engine_start_timeout_s)
        if self.profile == "slurm":
            cfg.SlurmEngineSetLauncher.submit_command = ["sbatch", *self.scheduler_args]
        elif self.profile == "mpi":
            args = list(self.scheduler_args)
            if _is_loopback_address(self._controller_address()) and "btl" not in args and _open_mpi_major() == 4:
                # Every engine on this host: Open MPI's shared-memory transport instead of TCP, whose
                # listeners would bind every interface.
                args += ["--mca", "btl", "self,vader"]
            cfg.MPIEngineSetLauncher.mpi_args = args
        return cfg

    def _log_tails(self, lines: int = 20) -> str:
        """The last lines of every log in the private folder (controller, engines, batch output)."""
        if not self._profile_dir or not os.path.isdir(self._profile_dir):
            return ""
        out = []
        for path in sorted(Path(self._profile_dir).rglob("*")):
            if path.is_file() and (path.suffix in (".log", ".out", ".err") or path.parent.name == "log"):
                try:
                    tail = path.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    continue
                if tail:
                    out.append(f"--- {path.name} (last {len(tail)} lines) ---\n" + "\n".join(tail))
        return "\n".join(out)

    def _pids_file(self) -> str:
        return os.path.join(self._profile_dir, "pids")

    def _start_reaper(self) -> None:
        # A separate watchdog kills controller and engines (and removes the private folder) if this
        # kernel dies abruptly. It re-reads the pids file, which replacements update.
        import subprocess

        write_pids(self._pids_file(), self.pids())
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "mlmkit.cluster.reaper", str(os.getpid()), start_token(os.getpid()) or "-",
             self._pids_file(), self._profile_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    @classmethod
    def attach(cls, connection_file: str, *, topology: Topology, **kwargs) -> "Cluster":
        """Use engines that something else started (e.g. a Slurm job, see cluster/README.md).

        ``connection_file`` is the controller's ``ipcontroller-client.json``. The engines become
        ranks as with :meth:`start`; :meth:`shutdown` drops the process groups and disconnects but
        leaves the engines to the job that owns them. A dead engine cannot be replaced from here.
        """
        import ipyparallel as ipp

        self = cls(topology=topology, profile=kwargs.pop("profile", "slurm"), **kwargs)
        t0 = time.perf_counter()
        self.client = ipp.Client(os.path.expanduser(connection_file))
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
            if inf["host"] == self._hostname:     # a pid of another host names nothing here
                self._all_pids.update([inf["pid"], *inf["children"]])
        self.view = self.client[self.engine_ids]
        self.view.block = False
        self._setup_ranks(range(self.world_size))

    def _stack_file(self, rank: int) -> Optional[str]:
        if self._profile_dir is None or not self._is_local(rank):
            return None
        return os.path.join(self._profile_dir, "stacks", f"rank{rank}.txt")

    def _setup_ranks(self, ranks) -> None:
        hosts = [inf["host"] for inf in self.info]
        per_host = Counter(hosts)
        seen: Counter = Counter()
        local = []
        for h in hosts:
            local.append(seen[h])
            seen[h] += 1
        results = {}
        # Engines import what the driver can: functions of the notebook's own modules (and of test
        # files) are shipped by reference and must resolve there too.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        for r in ranks:
            v = self.client[self.engine_ids[r]]
            v.execute(f"import sys as _sys; _sys.path[:0] = [p for p in {paths!r} if p not in _sys.path]; "
                      f"import torch; from mlmkit.cluster.engine import EngineState as _S; {STATE} = _S(); "
                      f"rank = {r}", block=True)
            threads = self.threads or max(1, (self.info[r]["cpus"] or 1) // per_host[hosts[r]])
            # Attached engines belong to their job: no driver watchdog.
            watch = self._is_local(r) and not self._attached
            results[r] = v.apply_async(
                _setup_remote, _ref(), rank=r, world_size=self.world_size, topology=self.topology,
                local_rank=local[r], threads=threads, backend=self.backend, timeout_s=self.collective_timeout_s,
                driver_pid=os.getpid() if watch else None, driver_token=start_token(os.getpid()) if watch else None,
                stack_file=self._stack_file(r))
        # Starting an engine (torch's import, the rank's setup) is bounded by the start timeout, not by
        # the per-call bound: a cluster with timeout_s=8 for fast failure reports must still start on
        # a busy laptop, where importing torch in 4 engines at once takes 10 s or more.
        for r, ar in results.items():
            out = ar.get(timeout=max(self.timeout_s, self.engine_start_timeout_s))
            if r < len(self.setup):
                self.setup[r] = out
            else:
                self.setup.append(out)

    def _is_local(self, rank: int) -> bool:
        # Called in the polling loop of every wait: compare against a hostname read once.
        return self.info[rank]["host"] == self._hostname

    def _connect_all(self, attempts: int = 4) -> None:
        """(Re)join every rank to a fresh torch.distributed world on a new free port, which rank 0
        binds and listens on before the others are told it (their stores then connect at once)."""
        from ipyparallel.error import RemoteError

        last = None
        for _ in range(attempts):
            # loopback only when every rank is on this host; else rank 0's routable address
            every_local = all(self._is_local(r) for r in range(self.world_size))
            master_host = "127.0.0.1" if every_local else self._raw(0, remote.host_address)
            port = self._raw(0, remote.reserve_port, master_host)
            pending = {r: self.client[self.engine_ids[r]].apply_async(_connect_remote, _ref(), master_host, port)
                       for r in range(self.world_size)}
            errors = {}
            deadline = time.monotonic() + self.timeout_s
            for r, ar in pending.items():
                try:
                    ar.get(timeout=max(0.1, deadline - time.monotonic()))
                except RemoteError as err:
                    errors[r] = _remote_text(err)
                except Exception as err:  # noqa: BLE001 - a timeout or a dead engine
                    errors[r] = f"{type(err).__name__}: {err}"
            if not errors:
                self.master = (master_host, port)
                self._broken = False
                return
            r = min(errors)
            last = RankError(r, errors[r], others={k: v for k, v in errors.items() if k != r},
                             note=" while joining torch.distributed")
            if not any("address already in use" in e.lower() for e in errors.values()):
                raise last
        raise last

    def _raw(self, rank: int, fn: Callable, *args):
        return self.client[self.engine_ids[rank]].apply_async(fn, _ref(), *args).get(timeout=self.timeout_s)

    def shutdown(self) -> list[int]:
        """Destroy process groups, stop engines and controller, and make sure no process is left.

        Returns the pids that had to be killed by force (normally none).
        """
        _STARTED.discard(self)
        if self.ipp_cluster is None and not self._attached:
            return []
        if self.client is not None and self.engine_ids:
            try:
                ars = [self.client[e].apply_async(remote.shutdown, _ref(), exit_on_term=not self._attached)
                       for e in self.engine_ids
                       if e in self.client.ids]
                for ar in ars:
                    ar.wait(timeout=5)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if self._attached:
            if self.client is not None:
                self.client.close()
            self.client = self.view = None
            self._attached = False
            return []
        pids = self.pids()
        if self.client is not None:
            self.client.close()
        # Engines first, then the controller: when its engine exits, each engine's nanny says so to
        # the controller and, if the controller is gone already, lingers 3 s on the unsent message.
        try:
            self.ipp_cluster.stop_engines_sync()
        except Exception:  # noqa: BLE001 - e.g. a batch job that was never submitted: nothing to cancel
            pass
        _reap(self._all_pids, wait_s=3.0, kill=False)
        try:
            self.ipp_cluster.stop_controller_sync()
        except Exception:  # noqa: BLE001 - stopped anyway below
            pass
        # Stopped (or found nothing to stop) here: ipyparallel must not try again at exit or on
        # garbage collection (a second traceback, and a profile folder written anew).
        self.ipp_cluster.shutdown_atexit = False
        killed = _reap(pids, wait_s=10.0)
        if self._profile_dir:
            # Anything still running for this private folder that the launchers lost track of (seen
            # once: a controller left behind by a failed batch start on a busy machine).
            killed += _reap(_processes_of_profile(self._profile_dir), wait_s=0.0)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(timeout=5)
            self._reaper = None
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
        """Every process of this cluster on this host: engines, their nannies, the controller and its
        schedulers (engines on other nodes of a batch job are their job's to stop)."""
        pids = set(self._all_pids)
        for engine_set in (getattr(self.ipp_cluster, "engines", None) or {}).values() if self.ipp_cluster else ():
            if getattr(engine_set, "zygote_pid", None) is not None:
                pids.add(engine_set.zygote_pid)       # the forked engines' parent (it exits after them)
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
        # A typo (timeout_s=-1) stopped every rank at once as hung; 0 silently meant the default.
        timeout_s = self.timeout_s if timeout_s is None else _check_seconds("timeout_s", timeout_s, upper=3600)
        self.ensure_healthy()
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        for r in ranks:
            self.topology._check_rank(r)
        ranks = [int(r) for r in ranks]           # results keyed by Python ints (a DataFrame's index is numpy)
        pending = {r: self.client[self.engine_ids[r]].apply_async(remote.call, _ref(), fn, args, kwargs)
                   for r in ranks}
        return self._wait(pending, timeout_s=timeout_s)

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
        """Repair what the last failure left: replace engines that were killed or vanished (e.g.
        killed between cells), and re-join every rank to a fresh ``torch.distributed`` world.

        Returns the ranks that got new engines (and bumps :attr:`generation` if any did)."""
        ids = set(self.client.ids)
        gone = sorted(r for r in range(self.world_size)
                      if r in self._doomed or self.engine_ids[r] not in ids or not self._engine_alive(r))
        if gone:
            for r in gone:
                if self._is_local(r):
                    _reap({self.info[r]["pid"], *self.info[r]["children"]}, wait_s=0.0)
            self._replace_engines(gone)
            self._doomed.clear()
            self._broken = True
        if self._broken:
            self._connect_all()
        return gone

    def rejoin(self) -> None:
        """Every rank re-joins a fresh ``torch.distributed`` world now (new port, new groups, the
        same trainers): nothing sent in the old world can reach the new one."""
        self._broken = True
        self.ensure_healthy()

    def activate(self, suffix: str = "") -> None:
        """Register ``%px``/``%%px`` magics on this cluster's engines (in rank order)."""
        view = self.client[self.engine_ids]
        view.block = True
        view.activate(suffix)

    # ================================================================== waiting and failures
    def _engine_alive(self, rank: int) -> bool:
        if not self._is_local(rank):
            return True  # remote hosts: ipyparallel reports the death itself
        from mlmkit.cluster.reaper import process_alive

        return process_alive(self.info[rank]["pid"])

    def _wait(self, pending: dict, *, timeout_s: float) -> dict[int, Any]:
        """Results of ``pending`` (rank -> AsyncResult), or an error raised promptly (module docstring)."""
        from ipyparallel.error import RemoteError

        deadline = time.monotonic() + timeout_s
        results, failures, dead = {}, {}, set()
        grace: Optional[_RunningClock] = None      # from the first failure: the peers' time to be released

        def poll(check_alive: bool = True) -> None:
            for r, ar in pending.items():
                if r in results or r in failures or r in dead:
                    continue
                if ar.ready():
                    try:
                        results[r] = ar.get(0)
                    except Exception as err:  # noqa: BLE001 - RemoteError, or EngineError when it died
                        # ipyparallel reports an engine it lost as a RemoteError named EngineError (its
                        # stranded tasks): dead, even if its process has not exited yet
                        if "EngineError" in (type(err).__name__, getattr(err, "ename", None)) \
                                or not self._engine_alive(r):
                            dead.add(r)
                        elif isinstance(err, RemoteError):
                            failures[r] = (time.monotonic(), _remote_text(err))
                        else:
                            failures[r] = (time.monotonic(), f"{type(err).__name__}: {err}")
                elif check_alive and not self._engine_alive(r):
                    dead.add(r)

        def unfinished() -> list[int]:
            return [r for r in pending if r not in results and r not in failures and r not in dead]

        # Woken by each reply (a callback of ipyparallel's I/O thread; its own callback marking the
        # result ready runs before): sleeping between looks cost every call half a sleep.
        wake = threading.Event()
        for ar in pending.values():
            ar.add_done_callback(lambda _result: wake.set())
        next_check = 0.0
        try:
            while unfinished():
                wake.clear()                            # before looking: a reply after the look wakes
                now = time.monotonic()
                check = now >= next_check               # a process check costs ~0.4 ms a rank
                if check:
                    next_check = now + LIVENESS_S
                poll(check)
                if (failures or dead) and grace is None:
                    grace = _RunningClock()
                if grace is not None and grace.elapsed() > self.grace_s:
                    break
                if now > deadline:
                    break
                if unfinished():
                    wake.wait(POLL_S)
        except KeyboardInterrupt:
            self._interrupt(unfinished(), poll, unfinished)
            raise
        stuck = unfinished()
        if not failures and not dead and not stuck:
            return {r: results[r] for r in pending}  # in the order asked (rank order by default)
        self._broken = True                          # every rank re-joins at the next call
        others = {r: tb for r, (_, tb) in failures.items()}
        if not failures and not dead:                # nobody failed: the bound ran out
            culprits, stacks = self._stop_stuck(stuck, poll, unfinished)
            r = culprits[0]
            where = "\n".join(_where(q, stacks.get(q)) for q in culprits)
            raise RankTimeout(r, f"ranks {culprits} did not finish within {timeout_s:g} s and were stopped (their "
                                 f"engines are replaced at the next call).\n{where}", ranks=culprits, stacks=stacks)
        unreleased = {}
        if stuck:                                    # blocked on a failed peer and not released: stop them
            stacks = self._dump_stacks(stuck)        # where they are (and a last moment to finish)
            poll()
            stuck = unfinished()
            unreleased = {r: stacks.get(r, "") for r in stuck}
            self._kill(stuck)
        note = f" (ranks {sorted(dead | set(stuck))} get new engines at the next call)" if (dead or stuck) else ""
        if dead:
            self._doomed.update(dead)
            r = sorted(dead)[0]
            crash = self._crash_stack(r)
            raise EngineDied(r, f"the engine of rank {r} (pid {self.info[r]['pid']}) died"
                                + (f"; it crashed:\n{crash}" if crash else ""), others=others, note=note,
                              unreleased=unreleased)
        r = _root_cause(failures)
        others.pop(r, None)
        raise RankError(r, failures[r][1], others=others, note=note, unreleased=unreleased)

    def _interrupt(self, busy: list[int], poll, unfinished) -> None:
        """Ctrl-C while waiting: SIGINT the busy engines (their Python code stops and aborts), then
        kill those still busy after ``grace_s``. The process groups are rebuilt at the next call."""
        self._broken = True
        for r in busy:
            if self._is_local(r):
                try:
                    os.kill(self.info[r]["pid"], signal.SIGINT)
                except OSError:
                    pass
        clock = _RunningClock()
        while unfinished() and clock.elapsed() < self.grace_s:
            poll()
            time.sleep(0.01)
        still = unfinished()
        if still:
            self._kill(still)

    def _stop_stuck(self, stuck: list[int], poll, unfinished) -> tuple[list[int], dict[int, str]]:
        """Kill the stuck ranks, sparing the ranks that only wait for them in communication."""
        stacks = self._dump_stacks(stuck)
        culprits = [r for r in stuck if not _blocked_in_communication(stacks.get(r, ""))] or stuck[:1]
        self._kill(culprits)
        clock = _RunningClock()                           # their peers error out once they are gone
        while unfinished() and clock.elapsed() < max(1.0, self.grace_s):
            poll()
            time.sleep(0.01)
        rest = unfinished()
        if rest:                                           # still running: stuck too
            self._kill(rest)
            culprits = sorted(set(culprits) | set(rest))
        return culprits, {r: stacks.get(r, "") for r in culprits}

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        files = {r: self._stack_file(r) for r in ranks}
        for r, f in files.items():
            if f is not None:
                try:
                    open(f, "w").close()                   # the engine appends; start empty
                    os.kill(self.info[r]["pid"], signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.3)
        out = {}
        for r, f in files.items():
            try:
                out[r] = _task_thread(open(f).read()) if f else ""
            except OSError:
                out[r] = ""
        return out

    def _crash_stack(self, rank: int) -> str:
        """What faulthandler wrote when the engine of ``rank`` crashed (a fatal signal): the error
        and the stack of the thread that ran the driver's call; empty if it was killed (SIGKILL,
        out of memory) or runs on another host."""
        f = self._stack_file(rank)
        try:
            text = open(f).read() if f else ""
        except OSError:
            return ""
        at = text.rfind("Fatal Python error")
        if at < 0:
            return ""
        first, _, rest = text[at:].partition("\n")
        rest = rest.split("\nExtension modules:")[0]        # faulthandler's list of C modules: noise here
        return (first + "\n" + _task_thread(rest)).strip()

    def _kill(self, ranks) -> None:
        for r in ranks:
            if self._is_local(r):
                _reap({self.info[r]["pid"], *self.info[r]["children"]}, wait_s=0.0)
            self._doomed.add(r)

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
            if inf["host"] == self._hostname:
                self._all_pids.update([inf["pid"], *inf["children"]])
        self.view = self.client[self.engine_ids]
        self.view.block = False
        if self._profile_dir:
            write_pids(self._pids_file(), self.pids())      # the reaper follows replacements
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
                         "tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp})
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
                        "gloo", "process group", "remote worker", "not initialized", "default process group",
                        "nonetype' object has no attribute")


def _consequence(tb: str) -> bool:
    low = tb.lower()
    return any(m in low for m in _CONSEQUENCE_MARKERS)


def _root_cause(failures: dict) -> int:
    """Among several failed ranks, the one whose error is not a consequence of a lost peer."""
    causes = [r for r, (_, tb) in failures.items() if not _consequence(tb.splitlines()[-1] if tb else "")]
    pool = causes or list(failures)
    return min(pool, key=lambda r: (failures[r][0], r))


def _task_thread(dump: str) -> str:
    """From a faulthandler dump of every thread, the thread running the driver's call (the one whose
    stack passes through :func:`mlmkit.cluster.engine.call`), or the whole dump if none does."""
    blocks, cur = [], []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) and cur:
            blocks.append(cur)
            cur = []
        cur.append(line)
    if cur:
        blocks.append(cur)
    for b in blocks:
        if any("mlmkit/cluster/engine.py" in ln and ln.rstrip().endswith(" in call") for ln in b):
            return "\n".join(b)
    return dump.strip()


_COMM_FRAMES = ("torch/distributed/", "mlmkit/distributed/comm_group.py")
_COMM_FUNCTIONS = ("_finish_recv", "_run_batch", "finalize", "barrier", "all_reduce", "all_gather", "reduce_scatter")


def _blocked_in_communication(stack: str) -> bool:
    """Whether the innermost frame of a faulthandler stack waits in communication (a collective, a
    receive, a batch of sends and receives): such a rank waits for a peer rather than being stuck."""
    frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return False
    top = frames[0]
    return any(f in top for f in _COMM_FRAMES) or any(top.endswith(f"in {fn}") for fn in _COMM_FUNCTIONS)


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _processes_of_profile(profile_dir: str) -> list[int]:
    """This user's processes started for ``profile_dir`` (ipyparallel gives its controller and
    engines ``IPP_PROFILE_DIR``), this process excluded."""
    import psutil

    me, uid, out = os.getpid(), os.getuid(), []
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["pid"] == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.environ().get("IPP_PROFILE_DIR") == profile_dir:
                out.append(proc.info["pid"])
        except psutil.Error:
            continue
    return out


def _reap(pids, *, wait_s: float, kill: bool = True) -> list[int]:
    """Wait up to ``wait_s`` for ``pids`` to exit, then SIGKILL the rest (``kill``); return the
    killed ones."""
    import psutil

    deadline = time.monotonic() + wait_s
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    killed = []
    for p in alive if kill else ():
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
