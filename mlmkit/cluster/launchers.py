"""ipyparallel launchers: local engines forked from one process, and batch launchers that keep their
files in the cluster's private folder.

:class:`ForkedEngineSetLauncher` starts a local cluster's engines as children of one process that
imported torch once (:mod:`mlmkit.cluster.zygote`), instead of one ``python -m ipyparallel.engine``
per engine that each import it again. Otherwise the engines are ipyparallel's own: each one's
launcher signals, stops and waits for it as for an engine it started itself.

ipyparallel writes a batch system's job file into the current folder (its launchers get
``work_dir='.'``); these write it, and point the job's output, into the profile folder that
:class:`mlmkit.cluster.Cluster` owns (mode 0700, removed at shutdown), so a notebook's folder stays
clean and a failed start can show the job's output.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time

import psutil
from ipyparallel.cluster.launcher import (LocalEngineLauncher, LocalEngineSetLauncher, MPIEngineSetLauncher,
                                          SlurmEngineSetLauncher)
from traitlets import Float

__all__ = ["ForkedEngineSetLauncher", "PrivateMPIEngineSetLauncher", "PrivateSlurmEngineSetLauncher"]


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine forked by a zygote: ipyparallel's local launcher, given the pid instead of
    starting the process; it signals and stops the engine as its own, and waits for it on a pidfd."""

    def start_forked(self, pid: int) -> int:
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()
        return pid

    def _wait(self):
        """Wait for the engine to exit without polling: psutil waits for a process that is not our
        child by looking every 40 ms, from one thread per engine in the notebook's kernel; a pidfd
        (Linux 5.3+) becomes readable when the process exits."""
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return super()._wait()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while not self._stop_waiting.is_set() and self.state == "running":
                    if sel.select(timeout=self.poll_seconds):
                        break
        finally:
            os.close(fd)
        stop_data = dict(exit_code=None, pid=self.pid, identifier=self.identifier)   # the zygote collects it
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """Local engines forked from one process that imported what every engine imports (see
    :mod:`mlmkit.cluster.zygote`): one import of torch per engine set instead of one per engine."""

    launcher_class = ForkedEngineLauncher
    start_timeout = Float(120.0, config=True, help="seconds the zygote may take to import and fork")
    zygote_pid = None

    def start(self, n):
        self.n = n
        log_dir = os.path.join(self.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        outputs = [os.path.join(log_dir, f"ipengine-{self.cluster_id}-{self.engine_set_id}-{i}.log")
                   for i in range(n)]
        env = os.environ.copy()
        env.update(self.get_env())
        zygote_log = os.path.join(log_dir, f"zygote-{self.cluster_id}-{self.engine_set_id}.log")
        with open(zygote_log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "mlmkit.cluster.zygote", self.profile_dir],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                    cwd=self.work_dir, start_new_session=True)
        self.zygote_pid = proc.pid
        try:
            proc.stdin.write(json.dumps({"argv": [*self.cluster_args, *self.engine_args],
                                         "outputs": outputs}).encode())
        except BrokenPipeError:
            pass                                  # it exited already: reading its pids says so, with its log
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        pids = self._read_pids(proc, n, zygote_log)
        dlist = []
        for i, pid in enumerate(pids):
            el = self.launchers[str(i)] = self.launcher_class(
                work_dir=self.work_dir, parent=self, log=self.log, profile_dir=self.profile_dir,
                cluster_id=self.cluster_id, environment=self.environment, identifier=str(i),
                output_file=outputs[i])
            el.on_stop(self._notice_engine_stopped)
            dlist.append(el.start_forked(pid))
        self.notify_start(dlist)
        return dlist

    def _read_pids(self, proc: subprocess.Popen, n: int, log: str) -> list[int]:
        """The children's pids, one line each, as the zygote forks them; its log if it fails."""
        text, deadline = b"", time.monotonic() + self.start_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while text.count(b"\n") < n:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    proc.kill()
                    raise RuntimeError(f"the engines' zygote did not fork {n} engines in {self.start_timeout:.0f} s"
                                       + _tail(log))
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    proc.wait(timeout=5)
                    raise RuntimeError(f"the engines' zygote exited with code {proc.returncode} before forking "
                                       f"{n} engines" + _tail(log))
                text += chunk
        proc.stdout.close()
        # The zygote stays as the engines' parent (it collects them); ours to collect when it exits.
        self._zygote = proc
        return [int(p) for p in text.split()]


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n--- zygote log ---\n" + "\n".join(tail)) if tail else ""


class PrivateSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """Slurm engines whose job file and output live in the profile folder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.work_dir = self.profile_dir
        self.batch_file = os.path.join(self.profile_dir, self.batch_file_name)


class PrivateMPIEngineSetLauncher(MPIEngineSetLauncher):
    """mpiexec engines started from the profile folder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.work_dir = self.profile_dir
