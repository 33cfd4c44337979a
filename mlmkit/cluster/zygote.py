"""Start a set of local engines by forking them from one process that has imported torch once.

Every engine of a CPU cluster imports the same modules before it can be a rank: ipyparallel's engine
and ipykernel, torch, ``torch._dynamo`` (which ``torch.optim`` imports on first use, see
:func:`mlmkit.distributed.process_groups._import_group_pinning_modules`) and mlmkit's trainer: about
4 s of CPU per engine. On a 2-core laptop 8 engines importing at once took 34 s to start, nearly all
of it those imports. A zygote (the name comes from Android, which starts its apps the same way)
imports them once and forks one child per engine; each child then runs ipyparallel's engine exactly
as ``python -m ipyparallel.engine`` would, in its own session, its output in its own log file.

``python -m mlmkit.cluster.zygote`` reads requests from stdin, one JSON object a line::

    {"argv": [engine arguments...], "outputs": [one log file per engine], "env": {...},
     "url_file": "<the controller's engine connection file>", "wait_s": 120}

imports once, and for each request forks one engine per output file (once ``url_file`` holds the
controller's whole connection file, so the controller and the imports start together) and writes
each child's pid on a line of stdout. It stays as the engines' parent: it collects each child
that exits (so none is left a zombie that psutil would count as running), and it forks the
replacement for an engine that died, when the driver asks, in milliseconds instead of the
seconds a fresh import of torch takes. It exits once stdin is closed (the driver shut the cluster
down, or the driver died) and its last child has exited. Its own errors go to stderr, which the
launcher points at a log file.

Forking is safe here because the zygote has done nothing but import: no process group, no ZMQ
context, no event loop, no thread, no CUDA context (checked: a zygote in which CUDA was initialised
refuses to fork) and no torch thread pool (created on the first parallel operation, after the
fork). It waits for its children and its requests in one thread (``select`` on stdin and on the
wake-up pipe of a SIGCHLD handler), which each child undoes before it becomes an engine.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import sys
import time
import traceback

#: What a rank imports anyway (the engine, the kernel it runs, torch and its compiler front end, the
#: trainer); anything not imported here a child imports itself, as before.
PRELOAD = ("ipyparallel.engine.app", "torch", "torch._dynamo", "mlmkit.train", "mlmkit.cluster.engine",
           "psutil", "pandas")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while importing; forked engines could not use it")


def _engine(argv: list[str], output: str, env: dict, wake: tuple[int, int]) -> None:
    """In the child: become an engine process and never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)                      # the zygote's way of waiting, not the engine's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        if env:
            os.environ.clear()
            os.environ.update(env)
        os.setsid()                                   # as Popen(start_new_session=True): no signal from the driver's terminal
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        gc.enable()
        sys.argv = ["ipengine", *argv]
        from ipyparallel.engine.app import main

        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the engine's log, as an exec'd engine would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _connection_file_complete(path: str) -> bool:
    """The controller writes its connection file in place: an engine that reads it half written
    fails. Complete once it parses and names where to register."""
    try:
        with open(path) as f:
            return "registration" in json.load(f)
    except (OSError, ValueError):
        return False


def _wait_for(path: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while path and not _connection_file_complete(path) and time.monotonic() < deadline:
        time.sleep(0.02)           # past the deadline the engines start anyway and say what is missing


class _Lines:
    """Whole lines from a file descriptor that ``select`` said is readable (no buffering behind
    ``select``'s back)."""

    def __init__(self, fd: int):
        self.fd, self.buffer, self.closed = fd, b"", False

    def read(self) -> list[bytes]:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.closed = True
            chunk = b"\n"                  # a last request without its newline still counts
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line for line in lines if line.strip()]


def _fork_engines(request: dict, wake: tuple[int, int], children: set[int]) -> None:
    _wait_for(request.get("url_file", ""), float(request.get("wait_s", 0)))
    sys.stdout.flush()
    sys.stderr.flush()
    for output in request["outputs"]:
        try:
            pid = os.fork()
        except OSError as err:             # out of memory or processes: the launcher says so
            sys.stdout.write(f"error: fork failed: {err}\n")
            sys.stdout.flush()
            return
        if pid == 0:
            _engine(list(request["argv"]), output, dict(request.get("env") or {}), wake)
        children.add(pid)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


def _collect(children: set[int]) -> None:
    while children:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


def main() -> int:
    requests = _Lines(0)
    first = []
    while not first and not requests.closed:     # the first request, before the imports' seconds
        select.select([0], [], [])
        first = requests.read()
    if not first:
        return 0                                  # closed before asking for anything
    _preload()
    # Objects alive now stay alive in every child; out of the collector's sight, a child's
    # collections do not write to (and so copy) the pages they live in.
    gc.collect()
    gc.disable()
    gc.freeze()
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)    # a handler, so that the wake-up pipe is written
    signal.set_wakeup_fd(wake[1])
    children: set[int] = set()
    pending = first
    while True:
        for line in pending:
            _fork_engines(json.loads(line), wake, children)
        pending = []
        _collect(children)
        if requests.closed and not children:
            return 0
        readable, _, _ = select.select([wake[0]] + ([] if requests.closed else [0]), [], [])
        if wake[0] in readable:
            try:
                while os.read(wake[0], 512):
                    pass
            except BlockingIOError:
                pass
        if 0 in readable:
            pending = requests.read()


if __name__ == "__main__":
    sys.exit(main())
