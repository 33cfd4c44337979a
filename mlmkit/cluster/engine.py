"""What runs inside each ipyparallel engine: one rank's state and the functions the driver calls.

Each engine's user namespace holds one :class:`EngineState` named ``mlmkit_rank`` (so ``%%px``
cells can use it: ``mlmkit_rank.rank``, ``mlmkit_rank.groups``, ``mlmkit_rank.trainer``). The
driver calls module-level functions of this file with that object as first argument through
:func:`call`, which turns any failure into an *abort*: the rank abandons the step in progress of
every trainer it holds (dropping its pending sends and receives: a pending ``Work`` keeps gloo's
connections open) and drops its process groups, which closes its connections, so peers blocked in
a collective or a receive with it fail within milliseconds instead of waiting for a timeout
(SIGINT cannot interrupt a rank blocked in gloo). Released peers abort in turn, so a whole chain
of waiting ranks is freed.

For a driver that must say where a stuck rank is, each local engine dumps its Python stacks to a
file on ``SIGUSR1`` (:mod:`faulthandler`).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["EngineState", "RemoteFailure", "call", "engine_info"]


class RemoteFailure(Exception):
    """Raised on an engine: carries the rank and the formatted traceback of the original error."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


def engine_info() -> dict:
    """Facts the driver needs to assign ranks and to check processes: pid, nanny, host, devices."""
    import psutil
    import torch

    me = psutil.Process()
    return {"pid": os.getpid(), "children": [c.pid for c in me.children(recursive=True)],
            "host": socket.gethostname(), "cuda_devices": torch.cuda.device_count(), "cpus": os.cpu_count()}


def _freeze_imports() -> None:
    """Import what a rank runs, then move every object alive now (modules, classes, functions:
    about 290,000 with torch) out of the cycle collector's sight (:func:`gc.freeze`). They live as
    long as the engine anyway. A full collection, which :meth:`EngineState.abort` runs after every
    failure, then takes under a millisecond instead of 0.15-0.2 s of CPU per rank; garbage made
    later (a failed step's frames, dropped trainers) is collected as before."""
    import mlmkit.train  # noqa: F401 - the trainer and everything it imports
    from mlmkit.distributed.process_groups import _import_group_pinning_modules

    _import_group_pinning_modules()          # torch._dynamo: imported before any group exists anyway
    gc.collect()
    gc.freeze()


class EngineState:
    """One rank living in an engine: its rank, devices, process groups and whatever a session adds."""

    def __init__(self):
        self.rank: Optional[int] = None
        self.world_size = 0
        self.topology = None
        self.groups = None
        self.device = None
        self.local_rank = 0
        self.backend: Optional[str] = None
        self.timeout_s = 30.0
        self.trainers: dict[str, Any] = {}    # session id -> Trainer
        self.trainer = None                   # the newest session's trainer (for %px exploration)
        self.data: dict[str, Any] = {}    # free space for user code
        self._watchdog: Optional[threading.Thread] = None
        self._stack_out = None
        self._listening: Optional[socket.socket] = None   # rank 0: the next world's store socket

    # ---------------------------------------------------------------- setup
    def setup(self, *, rank: int, world_size: int, topology, local_rank: int, threads: int,
              backend: Optional[str], timeout_s: float, driver_pid: Optional[int],
              driver_token: Optional[str] = None, stack_file: Optional[str] = None) -> dict:
        import torch

        from mlmkit.distributed import default_backend, default_device
        from mlmkit.distributed.host_memory import keep_freed_memory

        self.rank, self.world_size, self.topology = rank, world_size, topology
        self.local_rank, self.timeout_s = local_rank, timeout_s
        self.backend = backend or default_backend()
        os.environ["LOCAL_RANK"] = str(local_rank)
        self.device = default_device(local_rank, backend=self.backend)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(max(1, threads))
            keep_freed_memory()
        if driver_pid and self._watchdog is None:
            self._watchdog = threading.Thread(target=_watch_driver, args=(driver_pid, driver_token), daemon=True)
            self._watchdog.start()
        if stack_file:
            # Append mode: the driver truncates the file before asking for a fresh dump. Emptied
            # first: a replaced engine's crash must not be read as this one's.
            open(stack_file, "w").close()
            self._stack_out = open(stack_file, "a")
            faulthandler.register(signal.SIGUSR1, file=self._stack_out, all_threads=True)
            # A fatal error (an abort in a library, a segfault) leaves every thread's stack there
            # too: the driver's EngineDied shows where the engine was when it crashed.
            faulthandler.enable(file=self._stack_out, all_threads=True)
        _freeze_imports()
        return {"rank": rank, "device": str(self.device), "threads": torch.get_num_threads(), "backend": self.backend}

    def connect(self, *, master: str, port: int) -> None:
        """Join (or re-join) torch.distributed on ``master:port`` and (re)build the process groups.

        Existing :class:`~mlmkit.distributed.CommGroup` objects are updated in place, so models and
        trainers built on them keep working after a recovery.
        """
        import torch.distributed as dist

        from mlmkit.distributed import ProcessGroups, init_distributed

        self.abort(collect=False)   # after a failure the failed call already collected; healthy ranks need not
        listening, self._listening = self._listening, None
        if listening is not None and (self.rank != 0 or listening.getsockname()[1] != port):
            listening.close()
            listening = None
        init_distributed(rank=self.rank, world_size=self.world_size, init_method=f"tcp://{master}:{port}",
                         backend=self.backend, timeout_s=self.timeout_s, listen_socket=listening)
        fresh = ProcessGroups.build(self.topology, device=self.device)
        if self.groups is None:
            self.groups = fresh
        else:
            self.groups.adopt(fresh)     # every group, cp / dp-cp / tp-cp / expert groups included
        assert dist.is_initialized()

    def abort(self, *, collect: bool = True) -> None:
        """Abandon every trainer's step and drop every process group now (closes connections;
        peers blocked with us fail fast). ``collect``: also run the cycle collector, in case a
        reference cycle still holds a group (about a millisecond: the imports are frozen, see
        :func:`_freeze_imports`)."""
        import torch.distributed as dist

        for trainer in self.trainers.values():
            try:
                trainer.abandon_step()
            except Exception:  # noqa: BLE001 - dropping references must not fail the abort
                pass
        if self.groups is not None:
            self.groups.drop()           # a group left holding a process group keeps its connections open
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean destroy
                pass
        if collect:
            gc.collect()

    def __repr__(self) -> str:
        return f"EngineState(rank={self.rank}, device={self.device}, sessions={sorted(self.trainers)})"


def _watch_driver(pid: int, token: Optional[str]) -> None:
    # An engine whose notebook kernel was killed abruptly exits by itself (no orphans). A killed
    # kernel that its parent has not reaped yet is a zombie: dead, although its pid exists.
    from mlmkit.cluster.reaper import process_alive

    while True:
        time.sleep(1.0)
        if not process_alive(pid, token):
            os._exit(0)


class _InterruptOnlyInside:
    """SIGINT (the driver's Ctrl-C, forwarded) raises KeyboardInterrupt only while ``fn`` runs.

    A rank blocked in gloo's C code runs the Python handler only once the call returns; arriving
    then, during the abort or after the task, it must not cut the abort short or hit the next task.
    """

    def __init__(self):
        self.inside = False

    def __call__(self, signum, frame):
        if self.inside:
            raise KeyboardInterrupt("interrupted by the driver")

    def __enter__(self):
        self.inside = True
        try:
            self._old = signal.signal(signal.SIGINT, self)
        except ValueError:            # not the main thread: leave signals alone
            self._old = None
        return self

    def __exit__(self, *exc):
        self.inside = False
        return False

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def call(state: EngineState, fn: Callable, args: tuple, kwargs: dict):
    """Run ``fn(state, *args, **kwargs)``; on failure abort the groups and raise :class:`RemoteFailure`."""
    guard = _InterruptOnlyInside()
    try:
        try:
            with guard:
                return fn(state, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - every failure is reported with its rank
            tb = traceback.format_exc()
        # Outside the except block: the failed frames (which may hold the process group) are gone,
        # so dropping the groups really closes the connections.
        state.abort()
        raise RemoteFailure(state.rank if state.rank is not None else -1, tb)
    finally:
        guard.restore()


# --------------------------------------------------------------------------- engine-side helpers
def reserve_port(state: EngineState, host: str = "127.0.0.1") -> int:
    """Rank 0: bind a listening socket on a free port of ``host`` for the next world's store and
    return the port (:meth:`EngineState.connect` hands it to the store). The other ranks, told the
    port, then find it listening however late rank 0 starts its store: no client backs off (about
    half a second in torch's store), and no other process can take the port meanwhile."""
    from mlmkit.distributed.process_groups import listening_socket

    if state._listening is not None:
        state._listening.close()
    state._listening = listening_socket(host, 0, backlog=max(128, state.world_size))
    return state._listening.getsockname()[1]


def host_address(_state: EngineState) -> str:
    """An address of this engine's host that other hosts can reach (never a loopback address)."""
    from mlmkit.distributed.rendezvous import routable_address

    return routable_address()


def shutdown(state: EngineState, *, exit_on_term: bool = False) -> None:
    """Drop every trainer and process group. ``exit_on_term``: the engine is about to be stopped
    and keeps nothing worth a graceful exit, so SIGTERM ends it at once (ipykernel's graceful stop
    takes about a second of CPU per engine, and the engines of a cluster stop one after another on
    a small machine: 4 s for 4 engines here). Not for attached engines, which their job owns."""
    state.trainers.clear()
    state.trainer = None
    state.abort()
    if state._listening is not None:
        state._listening.close()
        state._listening = None
    if exit_on_term and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
