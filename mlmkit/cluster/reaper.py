"""A tiny watchdog process: when the notebook kernel that started a cluster dies (even by SIGKILL),
kill the cluster's controller and engines and remove its private folder, so nothing is left behind.

``python -m mlmkit.cluster.reaper DRIVER_PID DRIVER_CREATE_TIME PIDS_FILE FOLDER``: every second it
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


def process_alive(pid: int, create_time: Optional[float] = None) -> bool:
    """Whether ``pid`` is a running process (not a zombie), and the same one if ``create_time`` is given."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


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
    driver, ctime, pids_file, folder = int(argv[0]), float(argv[1]), argv[2], argv[3]
    pids: list[int] = read_pids(pids_file) or []
    while True:
        time.sleep(1.0)
        if not os.path.exists(pids_file):
            return 0                      # a normal shutdown removed the folder
        pids = read_pids(pids_file) or pids
        if process_alive(driver, ctime):
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
