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
        jobs[name] = (d, _sbatch([f"--ntasks={world}", "--overcommit", str(ROOT / "cluster" / "slurm_train.sbatch"),
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
    job = _sbatch(["--ntasks=3", "--overcommit", str(ROOT / "cluster" / "slurm_train.sbatch"), "run.json"], cwd=tmp_path)
    assert _wait(job) == "FAILED"
    log = (tmp_path / f"mlmkit-train-{job}.out").read_text()
    assert "needs 4 ranks but this job has 3 tasks" in log and "sbatch --ntasks=4" in log
