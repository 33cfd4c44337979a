"""Start a set of local engines by forking them from one process that has imported torch once.

Every engine of a CPU cluster imports the same modules before it can be a rank: ipyparallel's engine
and ipykernel, torch, ``torch._dynamo`` (which ``torch.optim`` imports on first use, see
:func:`mlmkit.distributed.process_groups._import_group_pinning_modules`) and mlmkit's trainer: about
4 s of CPU per engine. On a 2-core laptop 8 engines importing at once took 34 s to start, nearly all
of it those imports. A zygote (the name comes from Android, which starts its apps the same way)
imports them once and forks one child per engine; each child then runs ipyparallel's engine exactly
as ``python -m ipyparallel.engine`` would, in its own session, its output in its own log file.

``python -m mlmkit.cluster.zygote`` reads one JSON request on stdin::

    {"argv": [engine arguments...], "outputs": [one log file per engine]}

imports, forks one engine per output file, writes each child's pid on a line of stdout, closes
stdout, and then stays as the engines' parent: it collects each child that exits (so none is left
a zombie that psutil would count as running) and exits once the last one has. Its own errors go
to stderr, which the launcher points at a log file.

Forking is safe here because the zygote has done nothing but import: no process group, no ZMQ
context, no event loop, no CUDA context (checked: a zygote in which CUDA was initialised refuses
to fork) and no torch thread pool (created on the first parallel operation, after the fork).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
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


def _engine(argv: list[str], output: str) -> None:
    """In the child: become an engine process and never return."""
    code = 1
    try:
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


def main() -> int:
    request = json.loads(sys.stdin.read())
    argv, outputs = list(request["argv"]), list(request["outputs"])
    _preload()
    # Objects alive now stay alive in every child; out of the collector's sight, a child's
    # collections do not write to (and so copy) the pages they live in.
    gc.collect()
    gc.disable()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for output in outputs:
        pid = os.fork()
        if pid == 0:
            _engine(argv, output)
        children.append(pid)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    sys.stdout.close()
    os.close(1)
    while children:
        try:
            pid, _ = os.wait()
        except ChildProcessError:        # (a signal does not end the wait: Python retries it, PEP 475)
            break
        if pid in children:
            children.remove(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
