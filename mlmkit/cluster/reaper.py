"""A tiny watchdog process: when the notebook kernel that started a cluster dies (even by SIGKILL),
kill the cluster's controller and engines and remove its private folder, so nothing is left behind.

``python -m mlmkit.cluster.reaper DRIVER_PID DRIVER_START_TOKEN PIDS_FILE FOLDER`` (the token of
:func:`start_token`, or ``-`` where there is none): every second it
reads the pids to watch from ``PIDS_FILE`` (the cluster rewrites it whenever an engine is
replaced), so replacement engines are covered too. It exits by itself once the driver has shut the
cluster down (the pids file is gone), or kills the pids and removes ``FOLDER`` when the driver is
gone. A dead driver that its parent has not reaped yet (a zombie) counts as gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import Optional


def start_token(pid: int) -> Optional[str]:
    """When ``pid`` started, as a string that names that one process; ``None`` if it is gone.

    On Linux: its start time in clock ticks since boot (field 22 of ``/proc/PID/stat``), which never
    changes. Not psutil's ``create_time()``: Linux computes that from the boot time in whole seconds
    (``btime``), which is the wall clock minus the uptime and moves whenever the clock is slewed or
    stepped (NTP, a virtual machine's clock catching up), so two readings of one process a moment
    apart can differ by a whole second, and a watchdog comparing them took its live driver for dead
    (and stopped every engine). Elsewhere psutil's ``create_time()``, which macOS and Windows keep as
    a fixed timestamp.
    """
    import psutil

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()   # the name, in brackets, may hold spaces
        return f"ticks:{int(fields[19])}"                   # field 22, counted from field 3 (the state)
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None                                     # Linux, and the process is gone
    except (OSError, ValueError, IndexError):
        pass
    try:
        return f"time:{psutil.Process(pid).create_time()!r}"
    except psutil.Error:
        return None


def process_alive(pid: int, token: Optional[str] = None) -> bool:
    """Whether ``pid`` is a running process (not a zombie), and the one :func:`start_token` named
    ``token``, if given (the pid was not reused)."""
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    if token is None:
        return True
    now = start_token(pid)
    if now is None:
        return False
    if token.startswith("time:") and now.startswith("time:"):
        return abs(float(now[5:]) - float(token[5:])) < 1.0
    return now == token


def read_pids(path: str) -> Optional[list[int]]:
    try:
        with open(path) as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return None


def write_pids(path: str, pids) -> None:
    """Atomically replace the pids file the reaper watches."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(" ".join(str(p) for p in sorted(pids)))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    driver, token, pids_file, folder = int(argv[0]), argv[1], argv[2], argv[3]
    token = None if token == "-" else token          # "-": no start time to tell a reused pid apart
    pids: list[int] = read_pids(pids_file) or []
    while True:
        time.sleep(1.0)
        if not os.path.exists(pids_file):
            return 0                      # a normal shutdown removed the folder
        pids = read_pids(pids_file) or pids
        if process_alive(driver, token):
            continue
        for p in pids:
            if process_alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(folder, ignore_errors=True)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
