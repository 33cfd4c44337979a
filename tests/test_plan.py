"""The planner: its pipeline formula against the simulator, the search and its constraints, the
published results it must come close to, the command line, bad input."""

import json
import subprocess
import sys

import pytest

from mlmkit.model import GPTConfig
from mlmkit.model.presets import preset
from mlmkit.pipeline import make_schedule, simulate
from mlmkit.plan import GPUS, Hardware, Layout, plan, predict
from mlmkit.plan.published import ROWS, comparison
from mlmkit.plan.timing import pipeline_time

SMALL = GPTConfig(vocab_size=51200, seq_len=2048, hidden=4096, heads=32, layers=32)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("interleaved-1f1b", 4, 8, 2),
                                         ("interleaved-1f1b", 4, 12, 3)])
def test_pipeline_formula_equals_the_simulator(name, p, m, v):
    forward, backward = 3.0, 7.0            # per rank and microbatch, all its chunks together
    busy, bubble = pipeline_time(forward, backward, microbatches=m, stages=p, chunks=v)
    sim = simulate(make_schedule(name, stages=p, microbatches=m, chunks=v),
                   {"forward": forward / v, "backward": backward / v})
    assert busy + bubble == pytest.approx(sim.step_time)


def test_plan_ranks_by_throughput_and_keeps_constraints():
    table = plan(SMALL, gpus=64, gpu="h100-sxm", global_batch_size=256)
    fitting = table[table.fits]
    assert len(fitting) and fitting.tokens_per_s.is_monotonic_decreasing
    assert table.fits.iloc[: len(fitting)].all()                    # every fitting layout before the others
    assert ((table.tp * table.cp * table.pp * table.dp) == 64).all()
    constrained = plan(SMALL, gpus=64, gpu="h100-sxm", global_batch_size=256, tp=4, recompute="selective", zero=1)
    assert set(constrained.tp) == {4} and set(constrained.recompute) == {"selective"} and set(constrained.zero) == {1}
    best = table.iloc[0]
    assert 0 < best.mfu < 1 and best.model_tflops_per_gpu <= GPUS["h100-sxm"].peak_tflops
    parts = ["compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "bubble_s", "dp_comm_s", "optimizer_s"]
    assert (table[parts] >= 0).all().all()


def test_recomputation_costs_time_and_saves_memory():
    rows = {rc: predict(SMALL, GPUS["a100-80gb"], Layout(tp=8, pp=2, dp=4, micro_batch_size=1, recompute=rc),
                        global_batch_size=64) for rc in ("none", "selective", "full")}
    assert rows["none"]["step_time_s"] < rows["selective"]["step_time_s"] < rows["full"]["step_time_s"]
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["full"]["hardware_tflops_per_gpu"] > rows["full"]["model_tflops_per_gpu"]


def test_the_config_decides_dropout_and_flash_attention():
    layout = Layout(tp=8, pp=1, dp=1, micro_batch_size=1)
    kept = {drop: predict(GPTConfig(vocab_size=51200, seq_len=2048, hidden=4096, heads=32, layers=32, dropout=drop),
                          GPUS["a100-80gb"], layout, global_batch_size=8, flash_attention=False)["activation_bytes"]
            for drop in (0.0, 0.1)}
    assert kept[0.1] > kept[0.0]                                        # dropout masks counted, never dropped
    flash = predict(SMALL, GPUS["a100-80gb"], layout, global_batch_size=8)["activation_bytes"]
    eager = predict(SMALL, GPUS["a100-80gb"], layout, global_batch_size=8, flash_attention=False)["activation_bytes"]
    assert flash < eager                                                # no [s, s] scores kept


def test_published_results_within_15_percent_for_most_rows():
    table = comparison()
    assert len(table) == len(ROWS) >= 8 and table.source.nunique() >= 2
    close = (table.ratio - 1).abs() <= 0.15
    assert close.sum() >= 8, table[["result", "ratio"]]
    assert close[table.source.str.contains("2104.04473")].sum() >= 8


@pytest.mark.parametrize("kwargs,needle", [
    (dict(gpu="tpu-v9"), "unknown GPU 'tpu-v9'"),
    (dict(gpus=0), "gpus=0 must be a positive integer"),
    (dict(speed=3), "unknown constraint(s) ['speed']"),
    (dict(tp=3), "no layout of 64 GPUs"),
])
def test_bad_plan_input_names_the_value(kwargs, needle):
    args = dict(gpus=64, gpu="h100-sxm", global_batch_size=256)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        plan(SMALL, **args)
    assert needle in str(info.value)


def test_custom_hardware_is_validated():
    with pytest.raises(ValueError, match="peak_tflops=0"):
        Hardware(name="x", peak_tflops=0, memory_bytes=1, hbm_bandwidth=1, intra_node_bandwidth=1, gpus_per_node=8,
                 inter_node_bandwidth=1)
    assert all(h.source for h in GPUS.values())


def test_cli_json_and_constraints():
    out = subprocess.run([sys.executable, "-m", "mlmkit.plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu",
                          "a100-80gb", "--global-batch-size", "1536", "--seq-len", "2048", "--tp", "8", "--pp", "8",
                          "--top", "3", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 3 and all(r["tp"] == 8 and r["pp"] == 8 and r["dp"] == 16 for r in rows)
    keys = {"tp", "cp", "pp", "dp", "ep", "chunks", "schedule", "micro_batch_size", "recompute", "zero",
            "memory_per_gpu_bytes", "step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
            "mfu"}
    assert keys <= set(rows[0])
    shaped = subprocess.run([sys.executable, "-m", "mlmkit.plan", "--model", "llama3-8b", "--layers", "16", "--gpus",
                             "8", "--global-batch-size", "64", "--top", "1"], capture_output=True, text=True, timeout=120)
    assert shaped.returncode == 0 and "tokens_per_s" in shaped.stdout
    bad = subprocess.run([sys.executable, "-m", "mlmkit.plan", "--model", "nope", "--gpus", "8", "--global-batch-size",
                          "8"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def test_presets_plan():
    table = plan(preset("llama3-70b"), gpus=64, gpu="h200", global_batch_size=128, seq_len=4096, top=5)
    assert len(table) == 5 and table.fits.all()
