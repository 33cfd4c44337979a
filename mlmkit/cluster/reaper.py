"""A tiny watchdog process: when the notebook kernel that started a cluster dies (even by SIGKILL),
kill the cluster's controller and engines so that nothing is left behind.

``python -m mlmkit.cluster.reaper DRIVER_PID PID [PID ...]``: polls every second; exits by itself
once every listed pid is gone (a normal shutdown), or kills them when the driver disappears.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def main(argv: list[str]) -> int:
    driver, pids = int(argv[0]), [int(p) for p in argv[1:]]
    while True:
        time.sleep(1.0)
        left = [p for p in pids if _alive(p)]
        if not left:
            return 0
        if not _alive(driver):
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
