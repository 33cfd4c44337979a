"""Schedules to and from PyTorch's pipelining runtime: CSV round trip, mlmkit's schedules executed by
torch's ``_PipelineScheduleRuntime`` with PipelineStage modules built from mlmkit's GPT stages, and
torch's own schedules executed by mlmkit, all against the serial model."""

import os
import re
from dataclasses import replace

import pytest
import torch

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.model import GPT, gather_full, tiny_config
from mlmkit.pipeline import (Action, Schedule, ScheduleError, from_torch, make_schedule, schedule_from_table, simulate,
                             to_torch_csv, validate)
from mlmkit.pipeline.executor import PipelineExecutor, build_model_chunks, sync_embedding_grads

from random_schedules import draw_schedule, seeds_from_env

CFG = tiny_config(layers=8, hidden=32, heads=4, seq_len=8)
MB = 2
TOL = 1e-5
CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


def _data(m):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab_size, (m * MB, CFG.seq_len), generator=g)
    return tokens, torch.randint(0, CFG.vocab_size, (m * MB, CFG.seq_len), generator=g)


def _grads(models) -> dict:
    out = {}
    for model in models:
        out.update(gather_full(model, grads=True))
    return out


@pytest.mark.parametrize("name,chunks", CASES)
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_csv_round_trip(name, chunks, fmt, tmp_path):
    s = make_schedule(name, stages=4, microbatches=8, chunks=chunks)
    path = to_torch_csv(s, str(tmp_path / "s.csv"), format=fmt)
    rows = open(path).read().splitlines()
    assert len(rows) == 4 and all(rows)
    assert ("SEND_F" in open(path).read()) == (fmt == "compute_comms")
    back = from_torch(path)
    assert back.placement == s.placement and back.chunks == s.chunks
    assert back.actions == s.actions            # compute order and the messages inserted around it
    validate(back, batched=True)


def _torch_runtime(groups, sched, path, models, tokens, targets, fmt="compute_only"):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    stages = [PipelineStage(mod, mod.stage.index, sched.virtual_stages, torch.device("cpu"), group=groups.pp.pg)
              for mod in models]
    last = [mod for mod in models if mod.stage.post_process]
    runtime = _PipelineScheduleRuntime(stages, sched.microbatches, loss_fn=lambda out, tgt: last[0].loss(out, tgt))
    runtime._load_csv(path, format=fmt)
    losses = []
    args = (tokens,) if any(mod.stage.pre_process for mod in models) else ()
    runtime.step(*args, **(dict(target=targets, losses=losses) if last else {}))
    return sum(float(x.detach()) for x in losses) / len(losses) if losses else None


def _cross(rank, world_size, cases):
    """Per case (name, chunks, m, path, format): mlmkit's executor and torch's runtime running the
    CSV file, on the same weights and data."""
    groups = ProcessGroups.build(Topology(pp=world_size))
    out = []
    for name, chunks, m, path, fmt in cases:
        # a generator's schedule by name, or a Schedule as is (a random draw)
        sched = name if isinstance(name, Schedule) else make_schedule(name, stages=world_size, microbatches=m,
                                                                       chunks=chunks)
        tokens, targets = _data(m)
        ours = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=sched.placement,
                                  split_backward=sched.split_backward)
        loss_ours = PipelineExecutor(schedule=sched, chunks=ours, groups=groups).run_step(tokens, targets)
        theirs = build_model_chunks(CFG, groups=groups, chunks=chunks, placement=sched.placement)
        loss_theirs = _torch_runtime(groups, sched, path, theirs, tokens, targets, fmt)
        # torch's runtime does not know that the first and last stage share the (tied) word embedding:
        # sum the two copies' gradients as mlmkit's executor does at the end of its step.
        sync_embedding_grads(theirs, groups.embedding)
        out.append({"ours": (loss_ours, _grads(ours)), "theirs": (loss_theirs, _grads(theirs))})
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_torch_runtime_runs_mlmkit_schedules_and_agrees(pp, tmp_path):
    # Both CSV formats. compute_only: torch inserts its own messages. compute_comms: mlmkit writes them;
    # torch pairs messages between two ranks in posting order (no tags), and scales the gradients by
    # 1/m in each stage's REDUCE_GRAD. Written in mlmkit's action order, a V placement's messages
    # (zb-v, dualpipev; at pp=2 already) were swapped silently, and without REDUCE_GRAD every
    # gradient came out m times too large.
    m = 4 * pp
    cases = []
    for name, chunks in CASES + [("dualpipev", 2)]:
        for fmt in ("compute_only", "compute_comms"):
            path = to_torch_csv(make_schedule(name, stages=pp, microbatches=m, chunks=chunks),
                                str(tmp_path / f"{name}-{fmt}.csv"), format=fmt)
            cases.append((name, chunks, m, path, fmt))
    _check_cross(pp, cases)


def _check_cross(pp, cases):
    per_rank = run_ranks(_cross, world_size=pp, args=(cases,), timeout_s=max(300, 2 * len(cases)))
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        losses = {k: [r[k][0] for r in results if r[k][0] is not None] for k in ("ours", "theirs")}
        assert len(losses["ours"]) == len(losses["theirs"]) == 1
        assert abs(losses["ours"][0] - losses["theirs"][0]) <= TOL, case
        for r in results:
            (_, g_ours), (_, g_theirs) = r["ours"], r["theirs"]
            assert set(g_ours) == set(g_theirs)
            for n in g_ours:
                assert (g_ours[n] - g_theirs[n]).abs().max().item() <= TOL, (case, n)


@pytest.mark.parametrize("pp,default", [(2, "0:8"), (4, "100:104")])
def test_torch_runtime_runs_random_valid_schedules_and_agrees(pp, default, tmp_path):
    # Any valid order, not only the generators': drawn one ready action at a time (random_schedules.py),
    # with the last stage's forwards in microbatch order (what torch's runtime needs, see the next
    # test), written in both formats. 94 seeds at pp=2 and 80 at pp=4 agreed (MLMKIT_RANDOM_SCHEDULES).
    cases = []
    for seed in seeds_from_env("MLMKIT_RANDOM_SCHEDULES", default):
        sched, _ = draw_schedule(seed, stages=pp, placements=[(1, "loop"), (2, "loop"), (2, "v")],
                                 microbatches=[2, 3, pp, 2 * pp, 3 * pp], last_in_order=True)
        for fmt in ("compute_only", "compute_comms"):
            path = to_torch_csv(sched, str(tmp_path / f"{seed}-{fmt}.csv"), format=fmt)
            cases.append((sched, sched.chunks, sched.microbatches, path, fmt))
    _check_cross(pp, cases)


def _torch_on_csv(rank, world_size, path):
    groups = ProcessGroups.build(Topology(pp=world_size))
    sched = from_torch(path)
    models = build_model_chunks(CFG, groups=groups)
    loss = _torch_runtime(groups, sched, path, models, *_data(sched.microbatches))
    sync_embedding_grads(models, groups.embedding)
    return loss, _grads(models)


def test_a_last_stage_whose_forwards_run_out_of_order_is_not_exported(tmp_path):
    # torch's runtime takes microbatch k's loss from the last stage's k-th forward: random valid
    # schedules whose last stage ran F3 first stopped torch with "Loss for microbatch 3 is not
    # available" (its peer waiting for ever), and one that runs F1 before F0 gives silently wrong
    # gradients. mlmkit's executor runs it right (it keys each loss by its microbatch).
    rows = [(0, "F", 0), (0, "F", 1), (1, "F", 1), (1, "F", 0), (1, "B", 0), (1, "B", 1), (0, "B", 0), (0, "B", 1)]
    swapped = validate(schedule_from_table(rows, add_communication=True), batched=True)
    for fmt in ("compute_only", "compute_comms"):
        with pytest.raises(ScheduleError, match=re.escape(
                "rank 1, action #1 F(mb=1): torch's runtime takes microbatch k's loss from the last "
                "stage's k-th forward, and this last stage runs its forwards in the order [1, 0]")):
            to_torch_csv(swapped, str(tmp_path / "s.csv"), format=fmt)
    assert not (tmp_path / "s.csv").exists()
    # Why: the same schedule written by hand runs in torch's runtime with the serial loss and other
    # gradients (if this starts to fail, torch's runtime has learned to find losses by microbatch).
    path = tmp_path / "hand.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F1,1F0,1B0,1B1\n")
    per_rank = run_ranks(_torch_on_csv, world_size=2, args=(str(path),), timeout_s=120)
    ref_loss, ref_grads = _serial(2)
    assert abs([loss for loss, _ in per_rank if loss is not None][0] - ref_loss) <= TOL
    worst = max((g - ref_grads[n]).abs().max().item() for _, grads in per_rank for n, g in grads.items()
                if n != "head_weight")
    assert worst > 0.01, worst


def _serial(m):
    model = GPT(CFG)
    tokens, targets = _data(m)
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _stage_indices(cls_name, rank, world_size):
    """The two virtual stages ``rank`` holds under torch's schedule class: in a V, or looped."""
    if cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [rank, 2 * world_size - 1 - rank]
    return [rank, rank + world_size]


TORCH_CLASSES = [("ScheduleInterleaved1F1B", 8), ("ScheduleLoopedBFS", 8), ("ScheduleInterleavedZeroBubble", 8),
                 ("ScheduleZBVZeroBubble", 8), ("ScheduleDualPipeV", 8)]


def _run_torch_class(rank, world_size, cls_name, m, directory):
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage

    groups = ProcessGroups.build(Topology(pp=world_size))
    indices = _stage_indices(cls_name, rank, world_size)
    probe = [GPT(CFG, stage=_stage(i, 2 * world_size)) for i in indices]
    stages = [PipelineStage(mod, i, 2 * world_size, torch.device("cpu"), group=groups.pp.pg)
              for mod, i in zip(probe, indices)]
    torch_schedule = getattr(S, cls_name)(stages, m, loss_fn=lambda out, tgt: out.sum())
    sched = validate(from_torch(torch_schedule, name=cls_name), batched=True)
    if rank == 0:             # torch's own CSV of it (DualPipeV's overlapped pairs as "(0F3;3B1)OVERLAP_F_B")
        torch_schedule._dump_csv(os.path.join(directory, f"{cls_name}.csv"))
    models = build_model_chunks(CFG, groups=groups, chunks=2, placement=sched.placement,
                                split_backward=sched.split_backward)
    loss = PipelineExecutor(schedule=sched, chunks=models, groups=groups).run_step(*_data(m))
    return {"loss": loss, "grads": _grads(models), "schedule": sched}


def _stage(index, total):
    from mlmkit.model.gpt import Stage, split_layers

    return Stage(layers=split_layers(CFG.layers, total)[index], pre_process=index == 0, post_process=index == total - 1,
                 index=index)


@pytest.mark.parametrize("cls_name,m", TORCH_CLASSES)
def test_torch_schedules_run_in_mlmkit(cls_name, m, tmp_path):
    results = run_ranks(_run_torch_class, world_size=2, args=(cls_name, m, str(tmp_path)), timeout_s=120)
    ref_loss, ref_grads = _serial(m)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 1 and abs(losses[0] - ref_loss) <= TOL
    merged = {}
    for r in results:
        merged.update({k: v for k, v in r["grads"].items() if k != "head_weight"})
    for n, g in merged.items():
        assert (g - ref_grads[n]).abs().max().item() <= TOL, n
    sched = results[0]["schedule"]
    assert sched.chunks == 2 and sched.placement == ("v" if "V" in cls_name else "loop")
    simulate(sched, {"forward": 1.0, "backward": 1.0, "weight": 1.0})     # and it simulates
    # torch's _dump_csv of the same schedule reads back as the same order (a file a TrainConfig takes)
    dumped = from_torch(str(tmp_path / f"{cls_name}.csv"))
    assert [dumped.compute_actions(r) for r in range(2)] == [sched.compute_actions(r) for r in range(2)]


def test_from_torch_refuses_what_it_cannot_place(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,1F0\n0B0,1B0\n")       # stage 0 on ranks 0 and 1
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        from_torch(str(path))
    path.write_text("0F0,0Q1\n")
    with pytest.raises(ValueError, match="'0Q1' is not an action of torch's pipeline notation"):
        from_torch(str(path))
    path.write_text("0F0,()OVERLAP_F_B,0B0\n")
    with pytest.raises(ValueError, match=r"'\(\)OVERLAP_F_B' holds no action between its parentheses"):
        from_torch(str(path))
    path.write_text("0F0,(0F1;0Q0)OVERLAP_F_B\n")
    with pytest.raises(ValueError, match="'0Q0' is not an action of torch's pipeline notation"):
        from_torch(str(path))


def _mutate(rows: list, rng) -> list:
    """``rows`` (torch's cells per rank) with one to two random edits of the kinds a hand edit or a
    truncated file makes: a cell dropped, doubled, moved (within its rank or to another), renumbered
    (stage or microbatch, in range and out), given another kind, garbled or stripped of its
    microbatch; two cells joined into an overlapped pair as torch's DualPipeV writes it
    (``(0F3;3B1)OVERLAP_F_B``), well or badly formed; a rank emptied, dropped or doubled."""
    import re

    rows = [list(r) for r in rows]
    for _ in range(rng.randint(1, 2)):
        r = rng.randrange(len(rows))
        row = rows[r]
        op = rng.choice(["drop", "dup", "swap", "move", "mb", "stage", "kind", "garbage", "no_mb", "empty_rank",
                         "drop_rank", "dup_rank", "overlap", "bad_overlap"])
        if not row:
            continue
        i = rng.randrange(len(row))
        if op == "drop":
            del row[i]
        elif op == "dup":
            row.insert(rng.randrange(len(row) + 1), row[i])
        elif op == "swap":
            j = rng.randrange(len(row))
            row[i], row[j] = row[j], row[i]
        elif op == "move":
            rows[rng.randrange(len(rows))].insert(0, row.pop(i))
        elif op == "mb":
            row[i] = re.sub(r"\d+$", str(rng.choice([0, 1, 3, 7, 8, 10**11])), row[i])
        elif op == "stage":
            row[i] = re.sub(r"^\d+", str(rng.choice([0, 1, 3, 4, 7, 8, 9])), row[i])
        elif op == "kind":
            kinds = ["F", "B", "I", "W", "X", "SEND_F", "RECV_B", "REDUCE_GRAD"]
            row[i] = re.sub(r"[A-Z_]+", rng.choice(kinds), row[i])
        elif op == "garbage":
            row[i] = rng.choice(["", " ", "abc", "F0", "0F-1", "0f0", "0F1.5", "1e3F0", " 0F0 "])
        elif op == "no_mb":
            row[i] = re.sub(r"\d+$", "", row[i])
        elif op == "overlap" and i + 1 < len(row):
            row[i:i + 2] = [f"({row[i]};{row[i + 1]})OVERLAP_F_B"]
        elif op == "bad_overlap":
            row[i] = rng.choice(["()OVERLAP_F_B", "(;)OVERLAP_F_B", f"({row[i]}", f"({row[i]})", f"({row[i]};0Q0)X",
                                 f"(({row[i]}))OVERLAP_F_B", f"({row[i]};;)OVERLAP_F_B"])
        elif op == "empty_rank":
            rows[r] = []
        elif op == "drop_rank":
            del rows[r]
        else:
            rows.append(list(row))
    return rows


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_an_edited_csv_loads_as_a_valid_schedule_or_is_refused_by_name(fmt, tmp_path):
    # A CSV edited by hand or cut short either reads back as a schedule the validator accepts, or
    # raises a ScheduleError: never another exception (a compute cell without its microbatch, "0F",
    # failed with "'>' not supported between NoneType and int"), never a hang.
    import csv
    import random

    from mlmkit.pipeline.torch_bridge import torch_rows

    rng = random.Random(7)
    path = tmp_path / "edited.csv"
    outcomes = {"valid": 0, "refused": 0}
    wrong = []
    gens = [("gpipe", 3, 3, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 8, 1),
            ("zb-v", 2, 4, 2), ("dualpipev", 4, 8, 2)]
    for k in range(1200):
        name, p, m, v = gens[k % len(gens)]
        rows = _mutate(torch_rows(make_schedule(name, stages=p, microbatches=m, chunks=v), format=fmt), rng)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(rows)
        try:
            validate(from_torch(path, microbatches=rng.choice([None, m])), batched=True)
            outcomes["valid"] += 1
        except ScheduleError:
            outcomes["refused"] += 1
        except Exception as err:                                   # noqa: BLE001 (the sweep's point)
            wrong.append(f"{name} {rows}: {type(err).__name__}: {err}")
    assert not wrong, "\n".join(wrong[:5])
    assert min(outcomes.values()) > 20, outcomes                  # both outcomes drawn many times
    path.write_text("0F0,1F\n")
    with pytest.raises(ScheduleError, match="rank 0's '1F' names no microbatch: a compute action is "
                                            r"\{stage\}F\{microbatch\}, e.g. '1F0'"):
        from_torch(path)
    for bad in (0, 2.5, "4", True):
        with pytest.raises(ScheduleError, match=f"microbatches={bad!r} must be an integer >= 1"):
            from_torch(path, microbatches=bad)
    # Every adjacent pair of compute cells joined into an overlapped pair reads back as the same order.
    for name, p, m, v in gens:
        sched = make_schedule(name, stages=p, microbatches=m, chunks=v)
        rows = torch_rows(sched, format=fmt)
        joined = [[f"({a};{b})OVERLAP_F_B" for a, b in zip(row[::2], row[1::2])] + row[len(row) // 2 * 2:]
                  for row in rows]
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(joined)
        assert [a for r in range(p) for a in from_torch(path).compute_actions(r)] == \
            [a for r in range(p) for a in sched.compute_actions(r)], name


def test_bad_exports_name_the_fix_and_leave_the_file_alone(tmp_path):
    # A bad format raised only once the file was open for writing: an existing schedule was emptied.
    # A schedule's name raised AttributeError; a pathlib.Path was taken for a torch schedule.
    path = tmp_path / "s.csv"
    s = make_schedule("1f1b", stages=2, microbatches=4)
    to_torch_csv(s, str(path))
    before = path.read_text()
    with pytest.raises(ValueError, match=r"format='compute': expected 'compute_only' or 'compute_comms'"):
        to_torch_csv(s, str(path), format="compute")
    with pytest.raises(TypeError, match=r"expected an mlmkit Schedule, got str '1f1b': build one with "
                                        r"mlmkit.pipeline.make_schedule"):
        to_torch_csv("1f1b", str(path))
    assert path.read_text() == before
    assert from_torch(path).actions == s.actions                 # a Path reads like its str
    # A schedule that cannot run right is refused before torch's runtime gets it (torch runs what it
    # reads: a missing W leaves its weight gradients out, a V's tip out of order runs on no input).
    v = make_schedule("zb-v", stages=2, microbatches=4, chunks=2)
    no_w = replace(v, actions=(v.actions[0], tuple(a for a in v.actions[1] if a != Action("W", 3, 1))))
    tip = list(v.actions[1])
    f0, f1 = tip.index(Action("F", 0, 0)), tip.index(Action("F", 0, 1))
    tip[f0], tip[f1] = tip[f1], tip[f0]
    swapped = replace(v, actions=(v.actions[0], tuple(tip)))
    for bad, needle in ((no_w, r"rank 1: has no weight-gradient W for microbatch 3, chunk 1"),
                        (swapped, r"rank 1, action #\d+ F\(mb=0, chunk=1\): forward of microbatch 0, chunk 1 before "
                                  r"the forward it takes its input from")):
        for fmt in ("compute_only", "compute_comms"):
            with pytest.raises(ScheduleError, match=needle):
                to_torch_csv(bad, str(path), format=fmt)
    assert path.read_text() == before


# mlmkit's generators against PyTorch's classes of the same name (an implementation of the papers'
# orders written apart from mlmkit's): each rank's compute actions, F / I / W / B with microbatch and
# chunk, are the same, one by one. torch's zero-bubble H1 is not compared: mlmkit's takes the newest
# pending W (schedule.py says why), torch's the oldest.
SAME_ORDER = {"ScheduleInterleaved1F1B": "interleaved-1f1b", "ScheduleZBVZeroBubble": "zb-v",
              "ScheduleDualPipeV": "dualpipev"}


def _torch_orders(rank, world_size, microbatches):
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage

    groups = ProcessGroups.build(Topology(pp=world_size))
    out = {}
    for cls_name in SAME_ORDER:
        stages = [PipelineStage(torch.nn.Linear(1, 1), i, 2 * world_size, torch.device("cpu"), group=groups.pp.pg)
                  for i in _stage_indices(cls_name, rank, world_size)]
        for m in microbatches:
            if cls_name == "ScheduleInterleaved1F1B" and m % world_size:
                continue                          # torch takes whole rounds of p microbatches only
            if cls_name == "ScheduleDualPipeV" and m < 2 * world_size:
                continue                          # both refuse fewer microbatches than virtual stages
            sched = from_torch(getattr(S, cls_name)(stages, m, loss_fn=lambda out, tgt: out.sum()), name=cls_name)
            out[cls_name, m] = {r: [(a.kind, a.microbatch, a.chunk) for a in sched.compute_actions(r)]
                                for r in range(world_size)}
    return out


@pytest.mark.parametrize("p,microbatches", [(2, (2, 4, 5, 8)), (3, (3, 6, 7, 9)), (4, (4, 8, 11, 12, 16))])
def test_mlmkits_orders_are_torchs(p, microbatches):
    theirs = run_ranks(_torch_orders, world_size=p, args=(microbatches,), timeout_s=120)[0]
    assert {name for name, _ in theirs} == set(SAME_ORDER)
    for (cls_name, m), order in theirs.items():
        ours = make_schedule(SAME_ORDER[cls_name], stages=p, microbatches=m, chunks=2)
        for r in range(p):
            assert [(a.kind, a.microbatch, a.chunk) for a in ours.compute_actions(r)] == order[r], (cls_name, m, r)
    assert len(theirs) >= 2 * len(microbatches)
    for m in microbatches:
        if m < 2 * p:
            with pytest.raises(ScheduleError, match="at least as many microbatches as virtual stages"):
                make_schedule("dualpipev", stages=p, microbatches=m, chunks=2)
