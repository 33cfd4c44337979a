"""Traces (compute, communication, memory) against the pure-Python estimator; published figures; Chrome trace."""

import itertools
import json
import re
import socket

import numpy
import pytest
import torch

from mlmkit.distributed import run_ranks
from mlmkit.estimate import (
    activation_bytes_per_layer,
    bytes_per_parameter,
    estimate_comm,
    estimate_memory,
    estimate_train_comm,
    estimate_train_memory,
)
from mlmkit.estimate.compare import AXES, compare_comm, compare_memory
from mlmkit.model import GPTConfig
from mlmkit.model.config import llama_config
from mlmkit.trace.export import merge_traces, to_chrome_trace
from mlmkit.trace.memory import MemoryTracker
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import traced_step

MODEL = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=4)


LLAMA = llama_config(seq_len=16, hidden=32, heads=4, kv_heads=1, layers=4, ffn_hidden=64)
VARIANTS = {
    "plain": {},
    "sp+zero1+recompute": {"sequence_parallel": True, "zero1": True, "recompute": True},
    # Llama blocks, key/value heads replicated (tp=2 > kv_heads=1), bf16 with a bf16 gradient reduction,
    # selective recomputation, SP, ZeRO-1 (parameters gathered in bf16).
    "llama+bf16+sp+zero1+selective": {"model": LLAMA, "precision": "bf16", "grad_reduce": "bf16",
                                      "sequence_parallel": True, "zero1": True, "recompute": "selective"},
    # zero bubble: a split backward keeps every linear's input and output gradient from B to W
    "llama+zb-h1+bf16+sp": {"model": llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4, ffn_hidden=64),
                            "schedule": "zb-h1", "precision": "bf16", "sequence_parallel": True},
    # the eager attention path with dropout (masks from mlmkit's streams), fp32, unfused SwiGLU, full recompute
    "llama+eager-dropout+full": {"model": llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4,
                                                       ffn_hidden=64, dropout=0.1, gate_up_fused=False),
                                 "recompute": "full"},
    # context parallelism: the ring's key/value messages, dp-cp gradient reduction, ZeRO-1 over dp x cp,
    # Llama blocks with GQA, bf16, SP, selective recomputation (the ring reruns in backward)
    "llama+cp2+bf16+sp+zero1+selective": {"model": llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4,
                                                                ffn_hidden=64),
                                          "cp": 2, "dp": 1, "precision": "bf16", "sequence_parallel": True,
                                          "zero1": True, "recompute": "selective"},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def traced(request):
    options = dict(tp=2, pp=2, dp=2)
    options.update(VARIANTS[request.param])
    cfg = TrainConfig(model=options.pop("model", MODEL), micro_batch_size=2, global_batch_size=16, **options)
    traces = merge_traces(run_ranks(traced_step, world_size=8, args=(cfg.to_dict(),), timeout_s=300))
    return cfg, traces


def _options(cfg):
    return dict(micro_batch_size=cfg.micro_batch_size, microbatches=cfg.microbatches,
                sequence_parallel=cfg.sequence_parallel, zero1=cfg.zero1, schedule=cfg.schedule, chunks=cfg.chunks)


def test_measured_bytes_per_axis_equal_estimate(traced):
    cfg, traces = traced
    est = estimate_train_comm(cfg)
    table = compare_comm(traces["comm"], est)
    assert set(table.kind) == set(AXES)
    mismatched = table[table.measured != table.estimated]
    assert mismatched.empty, mismatched
    axes = ["tp", "pp", "dp"] + (["embedding"] if cfg.model.tie_embeddings else []) + (["cp"] if cfg.cp > 1 else [])
    assert (est[axes] > 0).all().all()                    # every axis really carried data
    if not cfg.model.tie_embeddings:
        assert (est["embedding"] == 0).all()              # untied: nothing to sum between first and last stage


def test_measured_memory_against_estimate(traced):
    cfg, traces = traced
    est = estimate_train_memory(cfg)
    table = compare_memory(traces["memory"], est)
    # every kind exact, the activation peak included (the schedule replayed, split-backward transients too)
    assert (table.measured == table.estimated).all(), table[table.measured != table.estimated]
    # The same as the lower-level call with every option spelled out.
    assert est.equals(estimate_memory(cfg.model, cfg.topology, recompute=cfg.recompute, precision=cfg.precision,
                                      **_options(cfg)))


# Peaks the variants above miss, on tp=2 x pp=2: inside a split backward's I (fc2's output gradient
# is kept before anything is freed: GELU, SP; with full recomputation every layer's tensors for W are
# kept before the chunk's first checkpointed input goes), and eager attention with grouped-query
# heads (it keeps the keys and values repeated per query head, not the projection's output).
PEAKS = {
    "gpt2-sp-zbh1": dict(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2),
                         sequence_parallel=True, schedule="zb-h1"),
    # ... with the mean of the microbatches' means (the loss keeps each microbatch's target count)
    "llama-eager-gqa-bf16-sp-zbh1-mean": dict(model=llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2,
                                                                 layers=2, ffn_hidden=64, attention="eager"),
                                              precision="bf16", sequence_parallel=True, schedule="zb-h1",
                                              per_token_loss=False),
    "llama-dropout-zbv-full": dict(model=llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4,
                                                      ffn_hidden=64, dropout=0.1),
                                   schedule="zb-v", chunks=2, recompute="full"),
    # A padded vocabulary: the loss keeps a bool mask of the padded columns on the tp rank whose slice
    # has them (259 -> 260 over tp=2, 300 -> 384: the second rank only), one per microbatch in flight
    # (GPipe: all four) and freed inside a split backward before the head's output gradient is kept.
    "gpt2-padded-vocab-gpipe": dict(model=GPTConfig(vocab_size=259, seq_len=16, hidden=32, heads=4, layers=2),
                                    schedule="gpipe"),
    "llama-padded-vocab-zbh1": dict(model=llama_config(vocab_size=300, make_vocab_size_divisible_by=64, seq_len=16,
                                                       hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=64),
                                    schedule="zb-h1"),
    # Ring attention with one head per tp rank and one sample per microbatch: the projection's input
    # is a view of the ring's output, not a reordered copy (one tensor, not two)
    "gpt2-cp2-one-head-per-rank": dict(model=GPTConfig(vocab_size=256, seq_len=16, hidden=16, heads=2, layers=2),
                                       cp=2, pp=1),
    # ... and under a split backward with two samples per microbatch: the projection's linear keeps its
    # input as it comes, a view of the ring's output (torch's linear would keep an [s b, h/t] copy)
    "gpt2-cp2-one-head-per-rank-zbh1-mbs2": dict(model=GPTConfig(vocab_size=256, seq_len=16, hidden=16, heads=2,
                                                                 layers=2),
                                                 cp=2, schedule="zb-h1", micro_batch_size=2),
}


def test_activation_peaks_inside_actions_are_exact():
    for name, options in PEAKS.items():
        cfg = TrainConfig(**{"tp": 2, "pp": 2, "micro_batch_size": 1, "global_batch_size": 4, **options})
        traces = merge_traces(run_ranks(traced_step, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300))
        table = compare_memory(traces["memory"], estimate_train_memory(cfg))
        assert (table.measured == table.estimated).all(), (name, table[table.measured != table.estimated])


# Uneven pipeline stages (layers not divisible by pp x chunks: the first stages take one layer more),
# where each rank's parameters, activations and messages differ from its peers'.
UNEVEN = {
    "gpt2-3-layers-zbh1-bf16-sp": dict(model=GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=3),
                                       schedule="zb-h1", precision="bf16", sequence_parallel=True, dp=2),
    "llama-5-layers-dualpipev-full": dict(model=llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=5,
                                                             ffn_hidden=64),
                                          schedule="dualpipev", chunks=2, recompute="full", dp=2),
    "llama-7-layers-pp4-gpipe-zero1-selective": dict(model=llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2,
                                                                        layers=7, ffn_hidden=64),
                                                     tp=1, pp=4, schedule="gpipe", zero1=True, dp=2,
                                                     recompute="selective"),
}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_stages_measured_equal_estimate(name):
    cfg = TrainConfig(**{"tp": 2, "pp": 2, "micro_batch_size": 1, "global_batch_size": 8, **UNEVEN[name]})
    assert cfg.model.layers % (cfg.pp * cfg.chunks)            # the stages really are uneven
    traces = merge_traces(run_ranks(traced_step, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300))
    memory = compare_memory(traces["memory"], estimate_train_memory(cfg))
    assert (memory.measured == memory.estimated).all(), memory[memory.measured != memory.estimated]
    comm = compare_comm(traces["comm"], estimate_train_comm(cfg))
    assert (comm.measured == comm.estimated).all(), comm[comm.measured != comm.estimated]
    # ranks of different stages hold different parameter and activation bytes
    for kind in ("parameters", "activations"):
        assert memory[memory.kind == kind].measured.nunique() > 1, kind


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flops_per_token_equal_torchs_count(recompute):
    # torch's FlopCounterMode counts every matmul of a forward and backward (recomputed ones too).
    # Eager attention: on CPU it does not count scaled_dot_product_attention's kernel. The formula
    # counts the attention over the full sequence, as the eager matmuls do (Megatron-LM's convention).
    from torch.utils.flop_counter import FlopCounterMode

    from mlmkit.estimate import forward_flops_per_token, training_flops_per_token
    from mlmkit.model.config import moe_config
    from mlmkit.model.gpt import GPT

    models = {"gpt2-odd-vocab": GPTConfig(vocab_size=250, seq_len=16, hidden=32, heads=4, layers=2, attention="eager"),
              # the head computes the padded columns too (300 -> 320): counted as Megatron-LM counts them
              "gpt2-padded-vocab": GPTConfig(vocab_size=300, make_vocab_size_divisible_by=64, seq_len=16, hidden=32,
                                             heads=4, layers=2, attention="eager", tie_embeddings=False),
              "llama-gqa": llama_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=64,
                                        attention="eager"),
              "moe-top2-shared": moe_config(seq_len=16, hidden=32, heads=4, kv_heads=2, ffn_hidden=64,
                                            moe_shared_ffn_hidden=32, moe_force_uniform=True, attention="eager")}
    for name, cfg in models.items():
        torch.manual_seed(0)
        model = GPT(cfg, recompute=recompute)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        with FlopCounterMode(display=False) as forward:
            loss = model(x, x)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
        tokens = x.numel()
        assert forward.get_total_flops() == forward_flops_per_token(cfg)["total"] * tokens, name
        assert forward.get_total_flops() + backward.get_total_flops() == \
            training_flops_per_token(cfg, recompute=recompute)["hardware"] * tokens, name
    # padded for tp ranks: 300 -> 384 over tp=2 (a multiple of 64 x 2)
    padded = models["gpt2-padded-vocab"]
    assert forward_flops_per_token(padded, tp=2)["head"] == 2 * 32 * 384
    assert training_flops_per_token(padded, tp=2)["model"] - training_flops_per_token(padded)["model"] == 3 * 2 * 32 * 64


def test_chrome_trace_holds_every_rank(traced, tmp_path):
    _, traces = traced
    path = to_chrome_trace(traces, str(tmp_path / "trace.json"))
    data = json.load(open(path))["traceEvents"]
    pids = {e["pid"] for e in data if e["ph"] == "X"}
    assert pids == set(range(8))
    compute = [e for e in data if e["ph"] == "X" and e.get("tid") == 0]
    assert len(compute) == len(traces["events"])
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in data if e["ph"] == "X")
    names = {e["args"]["name"] for e in data if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(8)}


def test_a_lone_rank_sends_nothing_and_says_so():
    # One process: no message at all; the table says 0 bytes (ratio 1), not a missing rank (NaN, inf).
    import pandas as pd

    cfg = TrainConfig(model=MODEL, micro_batch_size=2, global_batch_size=8)
    empty = pd.DataFrame(columns=["rank", "op", "axis", "ranks", "bytes", "wire_bytes", "start", "end", "site",
                                  "phase"])
    table = compare_comm(empty, estimate_train_comm(cfg))
    assert len(table) == len(AXES) and (table.measured == 0).all() and (table.ratio == 1.0).all(), table
    # With several ranks a rank missing from the trace stays unknown (NaN), never a silent 0.
    two = compare_comm(empty, estimate_train_comm(cfg.replace(dp=2, global_batch_size=8)))
    assert two.measured.isna().all()


def _two_steps_apart(rank, world_size, config_dict):
    import time

    from mlmkit.distributed import ProcessGroups
    from mlmkit.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(config_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    trainer.train_step()
    trainer.clear_traces()
    trainer.train_step()
    one = trainer.traces()
    time.sleep(0.5)                         # a notebook user between two cells
    trainer.train_step()
    return one, trainer.traces()


def test_a_trace_of_two_steps_reads_as_steps_not_as_one_long_one(tmp_path):
    # Measured on real ranks: the trace kept over two steps (0.5 s apart) has each row's step; its
    # bubble is the steps' bubbles (the wait between them counted as bubble made the share near 100%),
    # and its bytes per step compare with the estimate of one step (they were reported as twice it).
    from mlmkit.pipeline import make_schedule, replay
    from mlmkit.viz import bubble_table

    cfg = TrainConfig(model=MODEL, tp=2, pp=2, micro_batch_size=2, global_batch_size=8)
    runs = run_ranks(_two_steps_apart, world_size=4, args=(cfg.to_dict(),), timeout_s=300)
    one = merge_traces(r[0] for r in runs)
    two = merge_traces(r[1] for r in runs)
    # a dict by rank (what Cluster.run returns) merges the same; a list of something else is named
    by_rank = merge_traces({r: runs[r][1] for r in (3, 1, 0, 2)})
    assert all(by_rank[k].equals(two[k]) for k in ("events", "comm", "memory")) and by_rank["t0"] == two["t0"]
    with pytest.raises(ValueError, match=r"merge_traces: item 0 is a int, not one rank's traces"):
        merge_traces(list({r: runs[r][1] for r in range(4)}))
    assert one["clock"] == "monotonic"            # one machine: the times as recorded
    assert {r[0]["clock"]["host"] for r in runs} == {socket.gethostname()}
    assert set(one["events"].step) == set(one["comm"].step) == {1}
    assert set(two["events"].step) == set(two["comm"].step) == {1, 2}
    last = two["events"][two["events"].step == 2]
    first = bubble_table(one["events"]).idle + bubble_table(last).idle
    assert bubble_table(two["events"]).idle.to_dict() == pytest.approx(first.to_dict(), abs=1e-9)
    assert bubble_table(two["events"]).idle.max() < 0.5
    est = estimate_train_comm(cfg)
    for traces in (one, two):
        table = compare_comm(traces["comm"], est)
        assert (table.measured == table.estimated).all(), table
    with pytest.raises(ValueError, match=r"steps=1 but the trace holds 2 steps"):
        compare_comm(two["comm"], est, steps=1)
    schedule = make_schedule("1f1b", stages=2, microbatches=4)
    pipeline = cfg.topology.groups("pp")[0]
    with pytest.raises(ValueError, match=r"the timeline holds 2 steps \(1..2\): pass one, e.g. events\[events.step == 2\]"):
        replay(two["events"], schedule, ranks=pipeline)
    assert replay(last, schedule, ranks=pipeline).step_time > 0
    chrome = json.load(open(to_chrome_trace(two, str(tmp_path / "two.json"))))
    events = chrome["traceEvents"] if isinstance(chrome, dict) else chrome
    assert {e["args"]["step"] for e in events if e.get("ph") == "X" and e.get("cat") != "ring"} == {1, 2}


def test_traces_of_ranks_on_two_hosts_are_put_on_one_clock():
    # Each machine's monotonic clock counts from its own boot: stage 0 on a node up for a day and
    # stage 1 on one up for an hour sat 23 hours apart on one axis. Merged onto the wall clock (each
    # rank's trace says its host and its wall-minus-monotonic offset), the step reads as the step.
    import pandas as pd

    from mlmkit.viz import bubble_table

    def rank(r, host, boot_offset):
        events = pd.DataFrame([(r, "F", 0, 0, 5.0 + r + boot_offset, 6.0 + r + boot_offset, 0),
                               (r, "B", 0, 0, 8.0 - r + boot_offset, 10.0 - r + boot_offset, 0)],
                              columns=["rank", "action", "microbatch", "chunk", "start", "end", "step"])
        comm = pd.DataFrame([(r, "send", "pp", (r, 1 - r), 8, 8, 6.0 + boot_offset, 6.1 + boot_offset, "x", "", 0)],
                            columns=["rank", "op", "axis", "ranks", "bytes", "wire_bytes", "start", "end", "site",
                                     "phase", "step"])
        memory = pd.DataFrame({"rank": [r], "time": [6.0 + boot_offset]})
        return {"events": events, "comm": comm, "memory": memory,
                "clock": {"host": host, "wall_minus_monotonic": 1.7e9 - boot_offset}}

    apart = merge_traces([rank(0, "node-a", 86400.0), rank(1, "node-b", 3600.0)])
    assert apart["clock"] == "wall"
    ev = apart["events"]
    assert ev.start.max() - ev.start.min() == pytest.approx(3.0)
    assert bubble_table(ev).idle.to_dict() == pytest.approx({0: 2.0, 1: 2.0})
    assert apart["comm"].start.tolist() == pytest.approx([1.7e9 + 6.0] * 2)
    assert apart["memory"].time.tolist() == pytest.approx([1.7e9 + 6.0] * 2)
    assert apart["t0"] == pytest.approx(1.7e9 + 5.0)
    # One host: the shared monotonic clock, as recorded.
    same = merge_traces([rank(0, "node-a", 0.0), rank(1, "node-a", 0.0)])
    assert same["clock"] == "monotonic" and same["events"].start.min() == 5.0
    with pytest.raises(ValueError, match="several hosts, and some say nothing of their clock"):
        merge_traces([rank(0, "node-a", 0.0), rank(1, "node-b", 0.0), {k: v for k, v in rank(2, "", 0.0).items()
                                                                          if k != "clock"}])


def test_megatron_bytes_per_parameter():
    assert bytes_per_parameter(precision="bf16") == 18
    for d in (2, 4, 8, 64):
        assert bytes_per_parameter(precision="bf16", zero1=True, dp=d) == pytest.approx(6 + 12 / d)
    assert bytes_per_parameter(precision="fp32") == 16


def test_korthikanti_formulas_gpt3_175b():
    s, h, a, b, t = 2048, 12288, 96, 1, 8
    kw = dict(s=s, b=b, h=h, a=a, precision="bf16", implementation="megatron")
    sbh = s * b * h
    assert activation_bytes_per_layer(**kw) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(t=t, **kw) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(t=t, sequence_parallel=True, **kw) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(t=t, recompute=True, **kw) == pytest.approx(2 * sbh)
    assert activation_bytes_per_layer(t=t, sequence_parallel=True, recompute=True, **kw) == pytest.approx(2 * sbh / t)
    # Table 2 of the paper, in numbers: tensor + sequence parallelism keeps ~342 MiB per layer.
    assert activation_bytes_per_layer(t=t, sequence_parallel=True, **kw) / 2**20 == pytest.approx(342.0, abs=0.5)
    # Selective recomputation (section 5): the attention core is recomputed, 34 sbh/t with SP, sbh(10 + 24/t) without.
    assert activation_bytes_per_layer(t=t, sequence_parallel=True, recompute="selective", **kw) == pytest.approx(34 * sbh / t)
    assert activation_bytes_per_layer(t=t, recompute="selective", **kw) == pytest.approx(sbh * (10 + 24 / t))
    # Grouped-query attention: K and V shrink by kv_heads/a (2 bytes each): 8 KV heads of 96 save 4 sbh (1 - 8/96) / t.
    gqa = activation_bytes_per_layer(t=t, kv_heads=8, **kw)
    assert activation_bytes_per_layer(t=t, **kw) - gqa == pytest.approx(4 * sbh * (1 - 8 / a) / t)


def test_memory_tracker_counts_saved_storage_once():
    lin = torch.nn.Linear(64, 64)
    tracker = MemoryTracker(rank=0, params=lin.parameters())
    x = torch.randn(32, 64, requires_grad=True)
    with tracker.saving():
        y = lin(x)                    # saves x (not the weight: a parameter)
        z = (y * y).sum()             # saves y once (both operands are the same storage)
    assert tracker.activations == x.numel() * 4 + y.numel() * 4
    z.backward()
    del y, z
    assert tracker.activations == 0
    assert tracker.peak == 2 * 32 * 64 * 4
    tracker.record(action="F")
    row = tracker.frame().iloc[0]
    assert row.parameters == (64 * 64 + 64) * 4 and row.gradients == row.parameters


def test_estimators_never_assume_a_precision():
    from mlmkit.estimate import estimate_comm, estimate_memory
    from mlmkit.model import GPTConfig
    from mlmkit.model.config import moe_config
    from mlmkit import Topology

    model = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2)
    for fn in (estimate_memory, estimate_comm):
        with pytest.raises(ValueError, match="give precision='fp32' or 'bf16'"):
            fn(model, Topology(), micro_batch_size=1, microbatches=1)


def test_estimators_refuse_what_no_run_could_be():
    # A zero micro-batch size estimated an empty step; tp=3 of a hidden-32 model estimated shards no
    # trainer can build. Both are named, with the trainer's own check of the split.
    from mlmkit.estimate import estimate_comm, estimate_memory
    from mlmkit.model import GPTConfig
    from mlmkit.model.config import moe_config
    from mlmkit import Topology

    model = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2)
    for fn in (estimate_memory, estimate_comm):
        name = fn.__name__
        with pytest.raises(ValueError, match=f"{name}: micro_batch_size=0 must be an integer >= 1"):
            fn(model, Topology(tp=2), micro_batch_size=0, microbatches=2, precision="fp32")
        with pytest.raises(ValueError, match=f"{name}: microbatches=0 must be an integer >= 1"):
            fn(model, Topology(tp=2), micro_batch_size=2, microbatches=0, precision="fp32")
        with pytest.raises(ValueError, match="hidden=32 is not divisible by tp=3"):
            fn(model, Topology(tp=3), micro_batch_size=2, microbatches=2, precision="fp32")
        with pytest.raises(ValueError, match=r"3 pipeline stages \(pp=3 x chunks=1\) but only layers=2"):
            fn(model, Topology(pp=3), micro_batch_size=2, microbatches=3, precision="fp32")
        # zero=-1 or 5 was estimated as some stage, True as stage 1, 2.0 printed as 2.0
        for zero in (-1, 5, True, 2.0, "2"):
            with pytest.raises(ValueError, match=rf"{name}: zero={re.escape(repr(zero))} must be a ZeRO stage 0, 1, 2 or 3"):
                fn(model, Topology(dp=2), micro_batch_size=2, microbatches=2, precision="fp32", zero=zero)
        # a mixture of experts under ZeRO-2/3 is no run mlmkit makes (TrainConfig refuses it): its
        # experts were estimated as units sharded over dp x cp, which no runtime does
        with pytest.raises(ValueError, match=rf"{name}: zero=3 shards dense models only \(experts=4\)"):
            fn(moe_config(seq_len=16, hidden=32, heads=4, kv_heads=2, ffn_hidden=64), Topology(dp=2, ep=2, experts=True),
               micro_batch_size=1, microbatches=2, precision="fp32", zero=3)
        # switches that were read as truthy or falsy (sequence_parallel="no" estimated sequence parallelism,
        # recompute="ful" no recomputation), and a recomputation or precision of no run
        switches = ["sequence_parallel", "zero1", "reshard_after_forward"]
        switches += ["per_token_loss"] if fn is estimate_memory else []
        for switch, value in itertools.product(switches, ("no", 1, None, [])):
            with pytest.raises(ValueError, match=rf"{name}: {switch}={re.escape(repr(value))} must be True or False"):
                fn(model, Topology(tp=2), micro_batch_size=2, microbatches=2, precision="fp32", **{switch: value})
        for recompute in ("ful", 1, "FULL"):
            with pytest.raises(ValueError, match=rf"recompute={re.escape(repr(recompute))}.*'none', 'selective' or 'full'"):
                fn(model, Topology(tp=2), micro_batch_size=2, microbatches=2, precision="fp32", recompute=recompute)
        with pytest.raises(ValueError, match=r"precision=\[\]|unknown precision \[\]"):
            fn(model, Topology(tp=2), micro_batch_size=2, microbatches=2, precision=[])
    # numpy's bools (a DataFrame row's switches) are bools
    np_row = estimate_memory(model, Topology(tp=2), micro_batch_size=2, microbatches=2, precision="fp32",
                             sequence_parallel=numpy.bool_(True), per_token_loss=numpy.bool_(False))
    row = estimate_memory(model, Topology(tp=2), micro_batch_size=2, microbatches=2, precision="fp32",
                          sequence_parallel=True, per_token_loss=False)
    assert np_row.equals(row)
    with pytest.raises(ValueError, match=r"estimate_comm: placement='V'; expected one of loop, v"):
        estimate_comm(model, Topology(pp=2), micro_batch_size=2, microbatches=2, precision="fp32", placement="V")
    for prefetch in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match=rf"estimate_memory: prefetch={re.escape(repr(prefetch))} must be 0 or 1"):
            estimate_memory(model, Topology(dp=2), micro_batch_size=2, microbatches=2, precision="fp32", zero=3,
                            prefetch=prefetch)
    for bucket in (0, 1.5, True):          # the run's rule (TrainConfig, bucketize): 0 and 1.5 were estimated
        with pytest.raises(ValueError, match=rf"estimate_comm: bucket_bytes={re.escape(repr(bucket))} must be an integer"):
            estimate_comm(model, Topology(dp=2), micro_batch_size=2, microbatches=2, precision="fp32",
                          bucket_bytes=bucket)


def test_an_abandoned_step_frees_its_activations():
    # Saved outputs must not hold their own autograd node (node -> saved box -> tensor -> grad_fn):
    # such a cycle runs through C++, the collector cannot free it, and an abandoned step (reset,
    # failure) kept its activations for good.
    import gc

    from mlmkit.distributed import ProcessGroups
    from mlmkit.train import Trainer, demo_config

    trainer = Trainer(demo_config(tp=1, pp=1, dp=1, schedule="gpipe"), groups=ProcessGroups.single())
    trainer.begin_step()
    for _ in range(2):                      # GPipe: two forwards, no backward yet
        trainer.executor.step_action()
    assert trainer.memory.activations > 0
    trainer.abandon_step()
    gc.collect()
    assert trainer.memory.activations == 0
    trainer.train_step()                    # and the next step is whole
    assert trainer.memory.activations == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_wire_bytes_are_the_ring_algorithms(n):
    # What one rank sends (Patarasuk & Yuan 2009; Megatron-LM's and ZeRO's byte counts): an all-reduce
    # is a reduce-scatter then an all-gather, 2 (n - 1) steps of N / n; an all-gather or a reduce-scatter
    # (N the gathered size) n - 1 steps of N / n; a broadcast, a send or an all-to-all of N bytes puts N
    # on the wire, a receive nothing; a group of one sends nothing. The tracer and the estimator both
    # count with this function, so their agreement cannot show a wrong count: this test does.
    from mlmkit.trace import ring_wire_bytes

    N = 8 * 9 * 5 * 7                                   # divisible by every n here
    assert ring_wire_bytes("all_reduce", N, n) == (2 * (n - 1) * (N // n) if n > 1 else 0)
    for op in ("all_gather", "reduce_scatter"):
        assert ring_wire_bytes(op, N, n) == ((n - 1) * (N // n) if n > 1 else 0)
    assert ring_wire_bytes("recv", N, n) == 0
    for op in ("send", "all_to_all"):
        assert ring_wire_bytes(op, N, n) == N
    assert ring_wire_bytes("broadcast", N, n) == (N if n > 1 else 0)
    with pytest.raises(ValueError, match="unknown op 'gather'"):
        ring_wire_bytes("gather", N, max(n, 2))
