"""ipyparallel launchers: local engines forked from one process, and batch launchers that keep their
files in the cluster's private folder.

:class:`ForkedEngineSetLauncher` starts a local cluster's engines as children of one process that
imported torch once (:mod:`mlmkit.cluster.zygote`), instead of one ``python -m ipyparallel.engine``
per engine that each import it again; the same process forks the replacement of an engine that
died. Otherwise the engines are ipyparallel's own: each one's
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


class _Zygote:
    """The driver's end of one zygote process (:mod:`mlmkit.cluster.zygote`): ask it for engines,
    read their pids; closing it lets the zygote exit once its engines have."""

    def __init__(self, profile_dir: str, env: dict, log: str, cwd: str):
        self.log = log
        with open(log, "ab") as err:
            # The private folder on the command line: what `ps` shows, and what a clean-up finds.
            self.proc = subprocess.Popen([sys.executable, "-m", "mlmkit.cluster.zygote", profile_dir], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd,
                                         start_new_session=True)
        self.pid = self.proc.pid

    @property
    def open(self) -> bool:
        return not self.proc.stdin.closed and self.proc.poll() is None

    def fork(self, request: dict, timeout_s: float) -> list[int]:
        """Send one request; the pids of the engines it forked. Raises ``BrokenPipeError`` if the
        zygote is gone before it read the request, ``RuntimeError`` if it fails to fork them all."""
        n = len(request["outputs"])
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        text, deadline = b"", time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while text.count(b"\n") < n and b"error" not in text:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    self.proc.kill()
                    raise RuntimeError(f"the engines' zygote did not fork {n} engines in {timeout_s:.0f} s"
                                       + _tail(self.log))
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise self.exited(n)
                text += chunk
        lines = text.decode(errors="replace").splitlines()
        if any(line.startswith("error") for line in lines):
            raise RuntimeError(f"the engines' zygote could not fork {n} engines: "
                               + next(line for line in lines if line.startswith("error")))
        return [int(p) for p in lines]

    def exited(self, n: int) -> RuntimeError:
        """The error for a zygote that exited before forking ``n`` engines, with its log."""
        self.proc.wait(timeout=5)
        return RuntimeError(f"the engines' zygote exited with code {self.proc.returncode} before forking {n} engines"
                            + _tail(self.log))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """Local engines forked from one process that imported what every engine imports (see
    :mod:`mlmkit.cluster.zygote`): one import of torch per cluster instead of one per engine.

    The first engine set starts the zygote; later sets of the same cluster (the replacements of
    engines that died) are forked by the same zygote while it runs, in milliseconds. The zygote is
    kept on the ipyparallel cluster object that owns the engine sets."""

    launcher_class = ForkedEngineLauncher
    start_timeout = Float(120.0, config=True, help="seconds the zygote may take to import and fork")
    zygote_pid = None

    def _zygote(self, env: dict, log: str) -> tuple[_Zygote, bool]:
        """The cluster's running zygote, or a new one (and whether it is new)."""
        zygote = getattr(self.parent, "_mlmkit_zygote", None)
        if zygote is not None and zygote.open:
            return zygote, False
        zygote = _Zygote(self.profile_dir, env, log, self.work_dir)
        if self.parent is not None:
            self.parent._mlmkit_zygote = zygote
        return zygote, True

    def start(self, n):
        self.n = n
        log_dir = os.path.join(self.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        outputs = [os.path.join(log_dir, f"ipengine-{self.cluster_id}-{self.engine_set_id}-{i}.log")
                   for i in range(n)]
        env = os.environ.copy()
        env.update(self.get_env())
        name = f"ipcontroller-{self.cluster_id}-engine.json" if self.cluster_id else "ipcontroller-engine.json"
        # The zygote waits for the controller's connection file at most 30 s; then the engines start
        # anyway, wait ipyparallel's 10 s more and say in their logs what is missing.
        request = {"argv": [*self.cluster_args, *self.engine_args], "outputs": outputs, "env": env,
                   "url_file": os.path.join(self.profile_dir, "security", name),
                   "wait_s": min(30.0, self.start_timeout)}
        zygote_log = os.path.join(log_dir, f"zygote-{self.cluster_id}-{self.engine_set_id}.log")
        zygote, new = self._zygote(env, zygote_log)
        try:
            pids = zygote.fork(request, self.start_timeout)
        except BrokenPipeError:
            if new:
                raise zygote.exited(n) from None
            zygote.close()                       # it died between two sets: start another
            zygote, _ = self._zygote(env, zygote_log)
            pids = zygote.fork(request, self.start_timeout)
        self.zygote_pid = zygote.pid
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

    async def stop(self):
        """Stop the engines, and let the zygote exit after them (a cluster stops every set at once)."""
        zygote = getattr(self.parent, "_mlmkit_zygote", None)
        if zygote is not None:
            zygote.close()
        await super().stop()


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
