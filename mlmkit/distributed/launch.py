"""Run a function on N real processes joined by torch.distributed, and collect each rank's result.

This is the harness behind mlmkit's tests and benchmarks (and a handy tool in scripts)::

    def work(rank, world_size, n):
        x = torch.full((n,), float(rank))
        torch.distributed.all_reduce(x)
        return x

    results = run_ranks(work, world_size=4, args=(3,))   # [tensor([6., 6., 6.]), ...] per rank

Guarantees:
- a rank that raises makes :func:`run_ranks` raise :class:`RankFailure` naming that rank with its
  remote traceback; the other ranks are killed at once (they may be blocked in a collective, where
  no signal but SIGKILL reaches them);
- a rank that exits without a result (crash, ``os._exit``, killed) is reported the same way;
- nothing waits longer than ``timeout_s``: ranks still running then are sent SIGUSR1 (each dumps its
  Python stack), then killed, and :class:`RankTimeout` lists them with where they were stuck.

Processes come from a ``forkserver`` that has imported torch and mlmkit's trainer once
(:data:`PRELOAD`), so starting 8 ranks costs well under a second after the first call. ``fn`` must be
importable (a module-level function); :func:`preload_in_ranks` has the forkserver import its module
too, so that the ranks do not each import it (and what it imports) again.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import numbers
import os
import pickle
import queue as queue_mod
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["PRELOAD", "RankFailure", "RankTimeout", "find_free_port", "local_gpus", "max_local_ranks",
           "preload_in_ranks", "run_ranks"]

#: Memory one CPU rank (a process with torch imported: a :func:`run_ranks` rank, a cluster engine)
#: takes, measured ~0.3 GiB RSS, with headroom.
RANK_BYTES = 400 * 2**20
#: Never more CPU ranks on one machine than this, whatever the memory.
MAX_LOCAL_RANKS = 64


def max_local_ranks() -> int:
    """How many CPU ranks (processes with torch) this machine can hold: its available memory /
    :data:`RANK_BYTES`, at most :data:`MAX_LOCAL_RANKS` (several ranks may share a core: keep models
    tiny). Imports no torch."""
    import psutil

    return max(1, min(MAX_LOCAL_RANKS, int(psutil.virtual_memory().available // RANK_BYTES)))


def local_gpus() -> int:
    """GPUs CUDA offers on this machine (0 without CUDA): nccl ranks take one each."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


#: What every rank imports anyway, imported once by the forkserver that forks the ranks: torch, its
#: compiler front end (``torch.optim`` imports it on first use) and mlmkit's trainer (the model,
#: schedules and optimizer: 0.15-0.45 s of CPU per rank when each rank imported it itself).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "mlmkit.distributed.launch", "mlmkit.train.trainer")


class RankFailure(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed; ``remote_traceback`` its text."""

    def __init__(self, rank: int, remote_traceback: str, *, exitcode: Optional[int] = None):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others: dict[int, str] = {}  # later failures of other ranks (usually consequences)
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class RankTimeout(RuntimeError):
    """Ranks were still running at the deadline; ``ranks`` lists them, ``stacks`` where they were."""

    def __init__(self, ranks: Sequence[int], timeout_s: float, stacks: dict[int, str]):
        self.ranks = list(ranks)
        self.stacks = stacks
        detail = "\n".join(f"--- rank {r} was at:\n{stacks.get(r, '(no stack dumped)')}" for r in self.ranks)
        super().__init__(
            f"ranks {self.ranks} did not finish within {timeout_s:g} s and were killed "
            f"(a collective or recv without its peer?).\n{detail}"
        )


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results, threads: int, backend: Optional[str], collective_timeout_s: float,
            stack_file: str) -> None:
    # Runs in the child. Report exactly one message: ("ok", pickled result) or ("error", traceback).
    with open(stack_file, "w") as stack_out:
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=False)
        faulthandler.enable(file=stack_out, all_threads=False)   # a crash in C++ says where it was
        try:
            import torch
            import torch.distributed as dist

            from mlmkit.distributed.host_memory import keep_freed_memory
            from mlmkit.distributed.process_groups import init_distributed

            torch.set_num_threads(threads)
            if backend != "nccl":            # CPU ranks
                keep_freed_memory()
            os.environ["LOCAL_RANK"] = str(rank)
            init_distributed(rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                             backend=backend, timeout_s=collective_timeout_s)
            try:
                result = fn(rank, world_size, *args, **kwargs)
            except BaseException:  # noqa: BLE001 - everything is reported to the parent
                # Report before tearing the group down: the teardown makes peers fail too, and the
                # parent must hear the cause first (it also orders failures by time, read from the
                # monotonic clock: one for all processes of the machine, and a wall-clock step does
                # not reorder them).
                results.put((rank, "error", (time.monotonic(), traceback.format_exc())))
                return
            dist.destroy_process_group()
            results.put((rank, "ok", pickle.dumps(result)))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", (time.monotonic(), traceback.format_exc())))
        finally:
            faulthandler.disable()              # the file closes here: nothing may write to it after
            faulthandler.unregister(signal.SIGUSR1)


_CTX = None
_PRELOADED: list[str] = list(PRELOAD)   # what the forkserver imports: PRELOAD, then preload_in_ranks()'s


def _context():
    global _CTX  # a process-level cache of the forkserver context, not state anyone reads
    if _CTX is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        _CTX = mp.get_context(method)
        if method == "forkserver":
            _CTX.set_forkserver_preload(list(_PRELOADED))
    return _CTX


def preload_in_ranks(modules: Sequence[str]) -> tuple[str, ...]:
    """Have every rank that :func:`run_ranks` starts from now on begin with ``modules`` imported.

    A rank imports the module of the function it runs, and what that module imports, when it starts:
    for a test module that imports pytest and pandas, 0.3-0.5 s of CPU per rank, more than the rest
    of a small parity test's start. Preloaded, the forkserver imports them once and every rank is
    forked with them. Each module is imported here first (a name that cannot be imported is refused
    with the reason); if the forkserver already runs, it is restarted with the new list at the next
    :func:`run_ranks` (call this between runs, not while one is in progress).

    Returns every module the forkserver now imports (:data:`PRELOAD` first).
    """
    if isinstance(modules, str) or not isinstance(modules, Sequence) or \
            not all(isinstance(m, str) and m for m in modules):
        raise ValueError(f"preload_in_ranks: modules={modules!r} must be a list of module names, e.g. ['my_tests']")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - reported with the module's name
            raise ValueError(f"preload_in_ranks: module {name!r} cannot be imported in this process "
                             f"({type(err).__name__}: {err}); the forkserver would fail on it too. Fix the import "
                             f"or leave it out") from err
    new = [name for name in modules if name not in _PRELOADED]
    if new:
        _PRELOADED.extend(new)
        if _CTX is not None and _CTX.get_start_method() == "forkserver":
            from multiprocessing import forkserver

            _CTX.set_forkserver_preload(list(_PRELOADED))
            forkserver._forkserver._stop()      # started again, with the new list, by the next run
    return tuple(_PRELOADED)


def run_ranks(fn: Callable[..., Any], *, world_size: int, args: tuple = (), kwargs: Optional[dict] = None,
              timeout_s: float = 120.0, collective_timeout_s: Optional[float] = None, threads: int = 1,
              backend: Optional[str] = None, port_retries: int = 3) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results by rank.

    Args:
        fn: a module-level function (it is pickled by name).
        world_size: number of processes (ranks 0..world_size-1), on 127.0.0.1.
        timeout_s: bound on the whole run; ranks still running then are killed (RankTimeout).
        collective_timeout_s: torch.distributed timeout of the default group (default: timeout_s).
        threads: ``torch.set_num_threads`` in each rank (keep 1 when ranks share few cores).
        backend: "gloo" (CPU ranks) or "nccl" (a GPU per rank); default: nccl when CUDA has a GPU
            for every rank, else gloo on the CPU.
        port_retries: new ports to try when the rendezvous port was taken meanwhile.
    """
    # Checked before any process starts: a negative timeout killed every rank at once as hung,
    # threads=0 failed in every rank, backend "Gloo" only after the processes were up.
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size!r} must be an integer >= 1")
    if not callable(fn):
        raise ValueError(f"run_ranks: fn={fn!r} must be a module-level function")
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if value is None and name == "collective_timeout_s":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
            raise ValueError(f"run_ranks: {name}={value!r} must be a finite number of seconds > 0"
                             + (" (or None: timeout_s)" if name == "collective_timeout_s" else ""))
    # Seconds as floats and counts as ints (numpy's would reach timedelta and torch as types they refuse).
    timeout_s = float(timeout_s)
    collective_timeout_s = None if collective_timeout_s is None else float(collective_timeout_s)
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"run_ranks: threads={threads!r} must be an integer >= 1 (torch threads per rank)")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend={backend!r}: expected 'gloo', 'nccl' or None (nccl with CUDA, else gloo)")
    if isinstance(port_retries, bool) or not isinstance(port_retries, numbers.Integral) or port_retries < 0:
        raise ValueError(f"run_ranks: port_retries={port_retries!r} must be an integer >= 0")
    kwargs = kwargs or {}
    world_size, threads = int(world_size), int(threads)
    backend = _local_backend(backend, world_size)
    for attempt in range(port_retries + 1):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout_s,
                             collective_timeout_s or timeout_s, threads, backend)
        except RankFailure as err:
            if attempt < port_retries and "address already in use" in err.remote_traceback.lower():
                continue
            raise
    raise AssertionError("unreachable")


def _local_backend(backend: Optional[str], world_size: int) -> str:
    """The backend of ``world_size`` ranks on this machine, refused before any process starts where
    the machine cannot hold them: nccl gives each rank a GPU of its own (two ranks on one GPU fail
    in NCCL's set-up); gloo ranks run on the CPU, each a process with torch. ``None``: nccl where
    CUDA has a GPU for every rank, else gloo on the CPU (the tests on a one-GPU machine)."""
    gpus = local_gpus()
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"run_ranks: backend='nccl' gives each rank a GPU of its own, and this machine has {gpus} GPU(s) "
            f"for world_size={world_size}: use at most {gpus} ranks, or backend='gloo' (or None) to run the "
            f"ranks on the CPU" if gpus else
            "run_ranks: backend='nccl' needs CUDA, which this machine does not have; use backend='gloo' (or None)")
    if backend is None:
        backend = "nccl" if 0 < world_size <= gpus else "gloo"
    if backend == "gloo" and world_size > 1:
        limit = max_local_ranks()
        if world_size > limit:
            raise ValueError(
                f"run_ranks: world_size={world_size} is more than this machine can run: each CPU rank is a "
                f"process of about {RANK_BYTES / 2**30:.1f} GiB with torch loaded, and the available memory "
                f"holds {limit}. Use at most {limit} ranks here, or launch the job on several machines "
                f"(torchrun, Slurm).")
    return backend


def _run_once(fn, world_size, args, kwargs, timeout_s, collective_timeout_s, threads, backend):
    ctx = _context()
    port = find_free_port()
    results = ctx.Queue()
    stack_dir = tempfile.mkdtemp(prefix="mlmkit-ranks-")
    stack_files = [os.path.join(stack_dir, f"rank{r}.stack") for r in range(world_size)]
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_worker, name=f"mlmkit-rank{rank}", daemon=True,
                        args=(rank, world_size, port, fn, args, kwargs, results, threads, backend,
                              collective_timeout_s, stack_files[rank]))
        p.start()
        procs.append(p)

    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.05)
            except queue_mod.Empty:
                rank = None
            if rank is not None:
                if status == "error":
                    _raise_first_failure({rank: payload}, results, procs, done, stack_files)
                done[rank] = pickle.loads(payload)
                continue
            for r, p in enumerate(procs):
                if r not in done and p.exitcode is not None:
                    # Give a message that may still be in flight a moment to arrive.
                    try:
                        rank, status, payload = results.get(timeout=0.5)
                    except queue_mod.Empty:
                        raise RankFailure(r, _silent_exit(p.exitcode, stack_files[r]), exitcode=p.exitcode) from None
                    if status == "error":
                        _raise_first_failure({rank: payload}, results, procs, done, stack_files)
                    done[rank] = pickle.loads(payload)
                    break
            if time.monotonic() > deadline:
                stuck = [r for r in range(world_size) if r not in done]
                stacks = _dump_stacks(procs, stuck, stack_files)
                raise RankTimeout(stuck, timeout_s, stacks)
        return [done[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        for f in stack_files:
            try:
                os.remove(f)
            except OSError:
                pass
        try:
            os.rmdir(stack_dir)
        except OSError:
            pass


def _silent_exit(exitcode, stack_file: str) -> str:
    """Why a rank exited without a result, with what faulthandler wrote if it crashed."""
    text = f"process exited with code {exitcode} without a result (killed, crashed or called os._exit)"
    try:
        dump = open(stack_file).read()
    except OSError:
        return text
    at = dump.rfind("Fatal Python error")
    if at < 0:
        return text
    return text + ":\n" + dump[at:].split("\nExtension modules:")[0].strip()


def _raise_first_failure(errors: dict, results, procs, done, stack_files, grace_s: float = 0.5) -> None:
    """Wait ``grace_s`` for more failures, then raise for the one that caused the others.

    A rank that raises or dies makes its peers fail too (their collective loses its partner). A
    process that died without reporting (killed, crashed, ``os._exit``) is the cause; otherwise the
    earliest exception is. The rest are kept in ``RankFailure.others``.
    """
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=max(0.0, end - time.monotonic()))
        except queue_mod.Empty:
            break
        if status == "error":
            errors[rank] = payload
    silent = [r for r, p in enumerate(procs) if r not in errors and r not in done
              and p.exitcode is not None and p.exitcode != 0]
    if silent:
        r = silent[0]
        err = RankFailure(r, _silent_exit(procs[r].exitcode, stack_files[r]), exitcode=procs[r].exitcode)
        err.others = {k: tb for k, (_, tb) in errors.items()}
        raise err
    first = min(errors, key=lambda r: (errors[r][0], r))
    err = RankFailure(first, errors[first][1])
    err.others = {r: tb for r, (_, tb) in errors.items() if r != first}
    raise err


def _dump_stacks(procs, ranks, stack_files) -> dict[int, str]:
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.3)
    stacks = {}
    for r in ranks:
        try:
            with open(stack_files[r]) as f:
                stacks[r] = f.read().strip()
        except OSError:
            stacks[r] = ""
    return stacks

