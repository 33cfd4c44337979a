"""Slurm and MPI, for real: batch training submitted with cluster/slurm_train.sbatch, engines of a
Slurm job attached from a notebook, and Cluster(profile="slurm") / Cluster(profile="mpi").

Runs when a Slurm answers (``sinfo``); CI starts a single-node one bound to this machine
(``.ci/slurm-localhost start``) and sets ``MLMKIT_REQUIRE_SLURM=1``, which turns a missing Slurm
into a failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s.strip(" *") in ("idle", "mixed", "allocated") for s in out.stdout.split())


if not _slurm_up():
    if os.environ.get("MLMKIT_REQUIRE_SLURM") == "1":
        raise RuntimeError("MLMKIT_REQUIRE_SLURM=1 but no Slurm answers: run `.ci/slurm-localhost start` (root)")
    pytest.skip("no Slurm here (CI starts one with .ci/slurm-localhost)", allow_module_level=True)

CONFIG = {"tp": 2, "pp": 2, "dp": 1, "micro_batch_size": 4, "global_batch_size": 16,
          "model": {"vocab_size": 256, "seq_len": 32, "hidden": 64, "heads": 4, "layers": 4}}


def _sbatch(args, *, cwd, env=None) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, capture_output=True, text=True, timeout=30,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, timeout=10)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "GONE"


def _wait(job: str, timeout_s: float = 240.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _job_state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(0.3)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} did not finish within {timeout_s} s")


def _losses(csv: Path) -> list[float]:
    return list(pd.read_csv(csv)["loss"])


def test_sbatch_train_two_layouts_equal_the_local_run(tmp_path):
    # Submitted from a folder outside the repository with a relative config path, as a user would;
    # the task count comes from the config itself.
    import json

    runs = {"tp2 pp2": dict(CONFIG), "dp2": {**CONFIG, "tp": 1, "pp": 1, "dp": 2}}
    jobs = {}
    for name, cfg in runs.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        (d / "run.json").write_text(json.dumps(cfg))
        world = subprocess.run([PY, "-m", "mlmkit.train", "--config", "run.json", "--print-world-size"], cwd=d,
                               capture_output=True, text=True, check=True).stdout.strip()
        jobs[name] = (d, _sbatch([f"--ntasks={world}", str(ROOT / "cluster" / "slurm_train.sbatch"),
                                  "run.json", "--steps", "2", "--metrics-out", "metrics.csv"], cwd=d,
                                 env={"MLMKIT_SAVE_DIR": str(d / "ckpt")}))
    # the reference: one process, no launcher
    ref = tmp_path / "serial.csv"
    subprocess.run([PY, "-m", "mlmkit.train", "--config", str(tmp_path / "dp2" / "run.json"), "--tp", "1", "--pp", "1",
                    "--dp", "1", "--steps", "2", "--metrics-out", str(ref)], check=True, capture_output=True, timeout=120)
    for name, (d, job) in jobs.items():
        state = _wait(job)
        log = (d / f"mlmkit-train-{job}.out").read_text()
        assert state == "COMPLETED", f"{name}: {state}\n{log}"
        assert "rendezvous 127.0.0.1:" in log, log          # one node: nothing opened to the network
        assert _losses(d / "metrics.csv") == pytest.approx(_losses(ref), abs=1e-5), name
        assert (d / "ckpt").is_dir()


def test_sbatch_train_refuses_a_task_count_that_is_not_the_configs(tmp_path):
    import json

    (tmp_path / "run.json").write_text(json.dumps(CONFIG))
    job = _sbatch(["--ntasks=3", str(ROOT / "cluster" / "slurm_train.sbatch"), "run.json"], cwd=tmp_path)
    assert _wait(job) == "FAILED"
    log = (tmp_path / f"mlmkit-train-{job}.out").read_text()
    assert "needs 4 ranks but this job has 3 tasks" in log and "sbatch --ntasks=4" in log


# ------------------------------------------------------------------ engines, attach, profiles
#: Processes of the batch system and of MPI themselves: Slurm's daemons and its I/O forwarding, and
#: mpiexec's runtime, listen on every interface by design (neither has a bind address).
INFRASTRUCTURE = {"slurmctld", "slurmd", "slurmstepd", "srun", "munged", "mpiexec", "mpirun", "orted", "prterun",
                  "prted"}


def _non_loopback_listeners() -> list:
    import psutil

    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status != psutil.CONN_LISTEN or c.laddr.ip.startswith("127.") or c.laddr.ip == "::1":
            continue
        if not c.pid:                       # not a process of this session (the sandbox's agent)
            continue
        try:
            name = psutil.Process(c.pid).name()
        except psutil.Error:
            continue
        if name not in INFRASTRUCTURE:
            out.append((name, c.pid, c.laddr))
    return out


def _all_gone(pids, timeout_s: float = 20.0) -> bool:
    """Every pid has exited (a zombie waiting for its parent counts as exited) within the bound:
    a batch system stops a job's processes asynchronously."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.3)


def _steps(cluster, steps=2) -> list[float]:
    from mlmkit.train import demo_config

    config = demo_config(tp=1, pp=1, dp=cluster.world_size, global_batch_size=8, micro_batch_size=2)
    session = cluster.session(config)
    frame = session.train(steps, progress=False)
    return list(frame["loss"])


def _serial_losses(steps=2) -> list[float]:
    from mlmkit.distributed import ProcessGroups
    from mlmkit.train import Trainer, demo_config

    trainer = Trainer(demo_config(tp=1, pp=1, dp=1, global_batch_size=8, micro_batch_size=2),
                      groups=ProcessGroups.single())
    return [trainer.train_step()["loss"] for _ in range(steps)]


DRIVER = """
import sys
from mlmkit import Topology
from mlmkit.cluster import Cluster
cluster = Cluster.attach(sys.argv[1], topology=Topology(dp=2))
print(sorted(cluster.run(lambda r: r.rank).values()), [i["pid"] for i in cluster.info], flush=True)
"""


def test_engines_job_outlives_the_notebook_and_scancel_cleans_up(tmp_path):
    import psutil

    from mlmkit import Topology
    from mlmkit.cluster import Cluster

    job = _sbatch(["--ntasks=2", str(ROOT / "cluster" / "slurm_engines.sbatch")], cwd=tmp_path)
    folder = Path.home() / ".mlmkit" / f"slurm-{job}"
    client = "~/.mlmkit/slurm-%s/security/ipcontroller-client.json" % job       # as the README writes it
    try:
        deadline = time.monotonic() + 120
        while not (folder / "security" / "ipcontroller-client.json").exists():
            assert time.monotonic() < deadline and _job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
                (tmp_path / f"mlmkit-engines-{job}.out").read_text()
            time.sleep(0.3)
        # a first notebook attaches, trains... and its process ends
        first = subprocess.run([PY, "-c", DRIVER, client], capture_output=True, text=True, timeout=180)
        assert first.returncode == 0, first.stderr
        engine_pids = [int(p) for p in first.stdout.strip().rsplit("[", 1)[1].rstrip("]").split(",")]
        time.sleep(3)                               # a watchdog would have stopped them by now
        assert all(psutil.pid_exists(p) for p in engine_pids), "the engines died with the notebook"
        # ... a second one attaches to the same engines and trains exactly like one process
        cluster = Cluster.attach(client, topology=Topology(dp=2))
        try:
            assert [i["pid"] for i in cluster.info] == engine_pids
            assert _steps(cluster) == pytest.approx(_serial_losses(), abs=1e-5)
            assert _non_loopback_listeners() == []
        finally:
            cluster.shutdown()
        assert all(psutil.pid_exists(p) for p in engine_pids)          # shutdown leaves them to the job
    finally:
        subprocess.run(["scancel", job])
    _wait(job, 60)
    assert _all_gone(engine_pids), "scancel left engines behind"
    deadline = time.monotonic() + 20
    while folder.exists():
        assert time.monotonic() < deadline, f"scancel left {folder} behind"
        time.sleep(0.3)


def test_slurm_profile_trains_with_scheduler_args_and_keeps_its_files_private(tmp_path, monkeypatch):
    import psutil

    from mlmkit import Topology
    from mlmkit.cluster import Cluster

    monkeypatch.chdir(tmp_path)
    cluster = Cluster(topology=Topology(dp=2), profile="slurm", controller_ip="127.0.0.1",
                      scheduler_args=["--time=10", "--job-name=mlmkit-test"])
    with cluster:
        private = Path(cluster.private_dir)
        assert (private / "slurm_engine.sbatch").exists() and list(tmp_path.iterdir()) == []
        assert _steps(cluster) == pytest.approx(_serial_losses(), abs=1e-5)
        assert cluster.master[0] == "127.0.0.1" and _non_loopback_listeners() == []
        jobs = subprocess.run(["squeue", "-h", "-n", "mlmkit-test", "-o", "%i"], capture_output=True, text=True).stdout
        assert jobs.strip()
        pids = cluster.pids()
    assert not private.exists() and _all_gone(pids)
    for job in jobs.split():
        assert _wait(job, 60) != "RUNNING"


def test_a_failed_slurm_start_says_why_once(tmp_path):
    code = ("from mlmkit import Topology\nfrom mlmkit.cluster import Cluster\n"
            "Cluster(topology=Topology(dp=2), profile='slurm', controller_ip='127.0.0.1', "
            "scheduler_args=['--partition=no-such-partition'], engine_start_timeout_s=30).start()\n")
    out = subprocess.run([PY, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.count("Traceback") == 1, out.stderr          # one error, not ipyparallel's second
    assert "the engines did not start" in out.stderr and "--partition=no-such-partition" in out.stderr
    assert "ipcontroller" in out.stderr                            # the controller's log, read before removal
    assert list(tmp_path.iterdir()) == []                          # no job file here, no folder recreated
    import psutil                                                   # and no process left (the controller)

    left = [p.info for p in psutil.process_iter(["pid", "cmdline", "cwd"]) if p.info["cwd"] == str(tmp_path)]
    assert left == [], left


def _mpi_args() -> list:
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


@pytest.mark.skipif(shutil.which("mpiexec") is None and os.environ.get("MLMKIT_REQUIRE_SLURM") != "1",
                    reason="no mpiexec here")
def test_mpi_profile_trains():
    import psutil

    from mlmkit import Topology
    from mlmkit.cluster import Cluster

    with Cluster(topology=Topology(dp=2), profile="mpi", controller_ip="127.0.0.1", scheduler_args=_mpi_args()) as c:
        assert _steps(c) == pytest.approx(_serial_losses(), abs=1e-5)
        assert _non_loopback_listeners() == []
        pids = c.pids()
    assert _all_gone(pids)


def test_mpi_profile_refuses_clearly(monkeypatch):
    from mlmkit import Topology
    from mlmkit.cluster import Cluster

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    with pytest.raises(ValueError, match="refuses to run as root.*--allow-run-as-root"):
        Cluster(topology=Topology(dp=2), profile="mpi")
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "mpiexec" else real_which(name, *a, **k))
    with pytest.raises(ValueError, match="no mpiexec.*apt-get install openmpi-bin"):
        Cluster(topology=Topology(dp=2), profile="mpi")
    monkeypatch.setattr(shutil, "which", real_which)
    monkeypatch.setitem(sys.modules, "mpi4py", None)                 # import fails
    with pytest.raises(ValueError, match=r"mlmkit\[mpi\]"):
        Cluster(topology=Topology(dp=2), profile="mpi", scheduler_args=["--allow-run-as-root"])
    with pytest.raises(ValueError, match="scheduler_args are options for sbatch"):
        Cluster(topology=Topology(dp=2), scheduler_args=["--partition=x"])
