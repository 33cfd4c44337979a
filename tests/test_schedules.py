"""Schedules as data: known bubble results, validation of broken hand-written schedules, bad configs."""

import re

import pandas as pd
import pytest

from mlmkit.pipeline import (
    SCHEDULES,
    Action,
    Costs,
    ScheduleError,
    make_schedule,
    schedule_from_table,
    simulate,
    validate,
)

UNIFORM = {"forward": 1.0, "backward": 2.0}


def _chunks(name):
    return 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble(name, p, m):
    res = simulate(make_schedule(name, stages=p, microbatches=m), UNIFORM)
    expected = (p - 1) / (m + p - 1)
    assert res.bubble_fraction == pytest.approx(expected, abs=1e-9)
    for r in range(p):
        assert res.bubble_per_rank[r] == pytest.approx(expected, abs=1e-9)
    assert res.step_time == pytest.approx((m + p - 1) * 3.0, abs=1e-9)


@pytest.mark.parametrize("p,m", GRID)
def test_a_message_costs_its_latency_plus_its_bytes_over_the_bandwidth(p, m):
    # GPipe's forward wave crosses p - 1 links before the last stage starts, and the backward wave
    # the same links back after it: (m + p - 1)(F + B) + 2 (p - 1) hop, hop = latency + bytes / bandwidth.
    F, B, latency, nbytes, bandwidth = 1.0, 2.0, 0.1, 3e6, 1e7
    costs = Costs(forward=F, backward=B, p2p_latency=latency, p2p_bandwidth=bandwidth, message_bytes=nbytes)
    res = simulate(make_schedule("gpipe", stages=p, microbatches=m), costs)
    assert res.step_time == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * (latency + nbytes / bandwidth))
    # every schedule: the bytes cost exactly what the same time as latency costs
    for name in SCHEDULES:
        if name == "dualpipev" and m < 2 * p:
            continue                                  # it needs a microbatch per virtual stage
        s = make_schedule(name, stages=p, microbatches=m, chunks=_chunks(name))
        same = Costs(forward=F, backward=B, p2p_latency=latency + nbytes / bandwidth)
        assert simulate(s, costs).step_time == pytest.approx(simulate(s, same).step_time), name


@pytest.mark.parametrize("p,m", GRID)
def test_peak_inflight(p, m):
    gpipe = simulate(make_schedule("gpipe", stages=p, microbatches=m), UNIFORM)
    ofob = simulate(make_schedule("1f1b", stages=p, microbatches=m), UNIFORM)
    assert gpipe.peak_inflight == {r: m for r in range(p)}
    assert ofob.peak_inflight == {r: p - r for r in range(p)}


@pytest.mark.parametrize("p,m", GRID)
def test_interleaved_bubble_of_narayanan(p, m):
    v = 2
    res = simulate(make_schedule("interleaved-1f1b", stages=p, microbatches=m, chunks=v), UNIFORM)
    # Narayanan et al. 2021: bubble time / ideal time = (p - 1) / (v m).
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-9)
    one = simulate(make_schedule("1f1b", stages=p, microbatches=m), UNIFORM)
    assert res.bubble_ratio == pytest.approx(one.bubble_ratio / v, abs=1e-9)


@pytest.mark.parametrize("p,m,v,group", [(2, 4, 2, None), (4, 8, 2, None), (4, 8, 4, None), (4, 12, 3, None),
                                         (2, 5, 2, 3), (4, 4, 2, None), (3, 9, 2, None)])
def test_interleaved_warm_up_is_megatrons(p, m, v, group):
    # Megatron-LM's interleaved schedule runs 2 (p - r - 1) + (v - 1) group forwards of model chunks
    # before rank r's first backward (all m v of them when there are fewer), so the rank holds that
    # many plus one chunk activations at its peak. One warm-up forward more or less still gives a valid
    # schedule with the same numbers and, at these sizes, the same bubble; only the memory shows it.
    # On the first rank that is Korthikanti et al. 2022's p (1 + (p - 1) / (p v)) microbatches.
    g = group or p
    s = make_schedule("interleaved-1f1b", stages=p, microbatches=m, chunks=v,
                      **({} if group is None else {"microbatch_group": group}))
    res = simulate(s, UNIFORM)
    assert res.peak_inflight == {r: min(2 * (p - r - 1) + (v - 1) * g + 1, m * v) for r in range(p)}
    if group is None and m >= p + (p - 1) / v:
        assert res.peak_inflight[0] / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_h1_is_a_third_of_1f1b(p, m):
    costs = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
    zb = simulate(make_schedule("zb-h1", stages=p, microbatches=m), costs)
    ofob = simulate(make_schedule("1f1b", stages=p, microbatches=m), costs)
    idle = lambda r: r.step_time * r.bubble_fraction  # noqa: E731 - mean idle time per rank
    assert idle(ofob) == pytest.approx(3 * (p - 1), abs=1e-9)  # (p-1)(F+B+W)
    assert idle(zb) == pytest.approx((p - 1), abs=1e-9)        # (p-1)(F+B-W)
    assert idle(zb) / idle(ofob) == pytest.approx(1 / 3, abs=1e-9)


@pytest.mark.parametrize("p,m", GRID + [(3, 5), (4, 3)])
def test_zero_bubble_h1_runs_the_freshest_weight_gradient(p, m):
    # Each W takes the microbatch whose I ran last among those still pending (its X and dY still in
    # cache; the paper's and torch's order take the oldest). The slots are ZB-H1's, so at most p
    # weight gradients are held at any time (p - 1 after each W), and every microbatch's W runs once.
    s = make_schedule("zb-h1", stages=p, microbatches=m)
    for r, actions in enumerate(s.actions):
        pending, done = [], []
        for a in actions:
            if a.kind == "I":
                pending.append(a.microbatch)
                assert len(pending) <= p, (r, a, pending)
            elif a.kind == "W":
                assert pending and a.microbatch == pending[-1], (r, a, pending)
                done.append(pending.pop())
        assert not pending and sorted(done) == list(range(m)), (r, done)

def test_costs_per_stage_and_p2p():
    s = make_schedule("gpipe", stages=2, microbatches=2)
    res = simulate(s, Costs(forward=[1.0, 2.0], backward=[1.0, 1.0], p2p_latency=0.5))
    # rank 1 forwards take 2; each hop costs 0.5.
    tl = res.timeline
    f1 = tl[(tl["rank"] == 1) & (tl.action == "F")]
    assert list(f1.start) == [1.5, 3.5] and list(f1.end) == [3.5, 5.5]
    with pytest.raises(ValueError, match="unknown cost kind"):
        simulate(s, {"fwd": 1.0})
    with pytest.raises(ValueError, match="3 entries"):
        simulate(s, {"forward": [1, 2, 3]})


def test_timeline_has_one_block_per_compute_action():
    s = make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    tl = simulate(s, UNIFORM).timeline
    assert list(tl.columns) == ["rank", "action", "microbatch", "chunk", "start", "end"]
    assert len(tl) == 2 * 4 * 2 * 2
    assert (tl.groupby(["rank", "action", "microbatch", "chunk"]).size() == 1).all()


@pytest.mark.parametrize("name", SCHEDULES)
def test_generated_schedules_validate(name):
    for p in (2, 4):
        chunks = _chunks(name)
        validate(make_schedule(name, stages=p, microbatches=2 * p, chunks=chunks))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(name="interleaved-1f1b", stages=4, microbatches=2, chunks=2),
     "too few microbatches for 'interleaved-1f1b': microbatches=2 < stages=4"),
    (dict(name="interleaved-1f1b", stages=4, microbatches=6, chunks=2),
     "microbatches=6 leave a last group of 2 .* fewer microbatches than stages=4; Megatron-LM refuses it: it "
     "introduces dependency bubbles.*or microbatch_group=6"),
    (dict(name="interleaved-1f1b", stages=2, microbatches=5, chunks=2, microbatch_group=6), r"must lie in \[stages=2, "
     r"microbatches=5\], got 6"),
    (dict(name="1f1b", stages=2, microbatches=5, microbatch_group=3), "applies to 'interleaved-1f1b' only"),
    (dict(name="dualpipev", stages=4, microbatches=6, chunks=2), "dualpipev needs at least .* 8"),
    (dict(name="zb-v", stages=2, microbatches=4, chunks=3), "exactly 2 model chunks per rank"),
    (dict(name="interleaved-1f1b", stages=2, microbatches=4, chunks=3, layers=8),
     "chunks=3 does not divide the layers: layers=8"),
    (dict(name="1f1b", stages=4, microbatches=4, layers=3), "4 stages .* but only layers=3"),
    (dict(name="1f1b", stages=2, microbatches=4, chunks=2), "only 'interleaved-1f1b'"),
    (dict(name="pipedream", stages=2, microbatches=4), "unknown schedule 'pipedream'"),
    (dict(name="gpipe", stages=0, microbatches=4), "stages=0"),
    # a batch with a few zeros too many: refused, not listed action by action until memory runs out
    (dict(name="1f1b", stages=4, microbatches=10**9), r"microbatches=1000000000: .* at most 65536 microbatches"),
    # ... and stages with a few zeros too many (it built for half a minute, then ran out of memory)
    (dict(name="1f1b", stages=10**9, microbatches=4),
     r"stages=1000000000 x microbatches=4 x chunks=1 = 4000000000: .* at most 1048576 are planned"),
    (dict(name="interleaved-1f1b", stages=64, microbatches=8192, chunks=4), r"= 2097152: .* at most 1048576"),
])
def test_bad_configs(kwargs, needle):
    name = kwargs.pop("name")
    with pytest.raises(ScheduleError, match=needle):
        make_schedule(name, **kwargs)


@pytest.mark.parametrize("costs,needle", [
    ({"forward": -1.0, "backward": 2.0}, r"costs.forward=-1.0: every cost must be a finite number >= 0"),
    ({"forward": 1.0, "backward": float("nan")}, r"costs.backward=nan: every cost"),
    ({"forward": [1.0, -0.5], "backward": 2.0}, r"costs.forward=\[1.0, -0.5\]: every cost"),
    ({"forward": 1.0, "p2p_latency": float("inf")}, r"costs.p2p_latency=inf: every cost"),
])
def test_costs_no_run_could_have_are_refused(costs, needle):
    # A negative or NaN cost simulated into a NaN step or actions ending before they start.
    with pytest.raises(ValueError, match=needle):
        simulate(make_schedule("1f1b", stages=2, microbatches=4), costs)


@pytest.mark.parametrize("costs,needle", [
    ({"forward": {1: 1.0, 2: 3.0}, "backward": 2.0}, r"a mapping of costs must be keyed by rank \(or virtual stage\) 0..n-1"),
    ({"forward": {"a": 1.0}, "backward": 2.0}, r"keyed by rank"),
    ({"forward": "1.0", "backward": 2.0}, r"costs.forward='1.0' must be a number or a sequence of numbers"),
    ({"forward": [], "backward": 2.0}, r"costs.forward=\[\] is empty"),
    ({"forward": 1.0, "overhead": [0.1, 0.2]}, r"costs.overhead=\[0.1, 0.2\] must be one finite number"),
])
def test_costs_of_a_shape_no_schedule_reads_are_refused(costs, needle):
    with pytest.raises(ValueError, match=needle):
        simulate(make_schedule("1f1b", stages=2, microbatches=4), costs)


def test_costs_per_rank_read_the_same_in_every_container():
    # A mapping {rank: cost} was read as its keys (list(dict)): forward costs 0 and 1 instead of 5
    # and 7, a step of 14 instead of 43 without an error. Numpy scalars (a table's cells) failed with
    # "object is not iterable"; numpy cores were refused as "not a number".
    import numpy as np

    s = make_schedule("1f1b", stages=2, microbatches=4)
    want = simulate(s, {"forward": [5.0, 7.0], "backward": 2.0}).step_time
    assert want == 43.0
    for forward in ({0: 5.0, 1: 7.0}, {1: 7.0, 0: 5.0}, (5.0, 7.0), np.array([5.0, 7.0]), pd.Series([5.0, 7.0]),
                    [np.float32(5.0), np.int64(7)]):
        assert simulate(s, {"forward": forward, "backward": 2.0}).step_time == want, forward
    scalars = {"forward": np.float32(1.0), "backward": np.int64(2), "overhead": np.float64(0.0)}
    assert simulate(s, scalars).step_time == simulate(s, UNIFORM).step_time
    assert simulate(s, UNIFORM, cores=np.int64(1)).step_time == simulate(s, UNIFORM, cores=1).step_time
    costs = Costs(forward=np.array([5.0, 7.0]), backward=np.float32(2.0))
    assert costs.forward == [5.0, 7.0] and type(costs.backward) is float


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_ranks_sharing_cores_share_them_equally(p, m):
    from mlmkit.pipeline.simulate import shared_run

    # Processor sharing: the computing ranks split the cores, each at most one. On one core nothing
    # runs in parallel and, with free messages, some rank always computes: the step is the sum of
    # every rank's work. With a core per rank or more the ranks never slow down: the step is the
    # unshared one. In between the step lies between the two, and at least the work over the cores.
    costs = {"forward": 1.0, "backward": 2.0, "weight": 0.5}
    for name in SCHEDULES:
        if name == "dualpipev" and m < 2 * p:
            continue                                  # it needs a microbatch per virtual stage
        s = make_schedule(name, stages=p, microbatches=m, chunks=_chunks(name))
        alone = simulate(s, costs)
        work = sum(alone.busy_per_rank.values())
        assert simulate(s, costs, cores=1).step_time == pytest.approx(work), name
        for cores in (p, p + 1.5, 4 * p):
            assert simulate(s, costs, cores=cores).step_time == pytest.approx(alone.step_time), (name, cores)
            # (simulate then skips the sharing; the sharing model itself, given those cores, agrees)
            end = max(row[4] for row in shared_run(s, Costs.from_mapping(costs), cores=cores))
            assert end == pytest.approx(alone.step_time), (name, cores)
        half = simulate(s, costs, cores=p / 2).step_time
        assert max(alone.step_time, work / (p / 2)) - 1e-9 <= half <= work + 1e-9, name


@pytest.mark.parametrize("cores", [0, -2, float("nan"), float("inf"), True, "2", [2]])
def test_cores_that_are_not_a_positive_number_are_refused(cores):
    # True simulated as one core, "2" raised a TypeError from a comparison, inf was taken (as None).
    with pytest.raises(ValueError, match=rf"simulate: cores={re.escape(repr(cores))} must be a finite number > 0 "
                                         rf"\(or None"):
        simulate(make_schedule("1f1b", stages=2, microbatches=4), UNIFORM, cores=cores)
    assert simulate(make_schedule("1f1b", stages=2, microbatches=4), UNIFORM, cores=0.5).step_time > 0


def _table(rows):
    return schedule_from_table([dict(zip(("rank", "kind", "microbatch", "peer"), r)) for r in rows])


GOOD = [
    (0, "F", 0, None), (0, "SEND_ACT", 0, 1), (0, "RECV_GRAD", 0, 1), (0, "B", 0, None),
    (1, "RECV_ACT", 0, 0), (1, "F", 0, None), (1, "B", 0, None), (1, "SEND_GRAD", 0, 0),
]


def test_hand_written_schedule_validates_and_simulates():
    s = _table(GOOD)
    assert s.stages == 2 and s.microbatches == 1
    assert simulate(s, UNIFORM).step_time == pytest.approx(6.0)


def test_missing_recv_is_named():
    rows = [r for r in GOOD if not (r[0] == 1 and r[1] == "RECV_ACT")]
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 F\(mb=0\): RECV_ACT for microbatch 0 must come before"):
        validate(_table(rows))


def test_backward_before_forward_is_named():
    rows = [GOOD[0], GOOD[1], GOOD[2], GOOD[3], GOOD[4], GOOD[6], GOOD[5], GOOD[7]]
    with pytest.raises(ScheduleError, match=r"rank 1, action #1 B\(mb=0\): backward before its forward"):
        validate(_table(rows))


def test_deadlock_is_caught_by_the_dry_run():
    # Both ranks receive before they send: each waits for the other forever.
    rows = [
        (0, "F", 0, None), (0, "RECV_GRAD", 0, 1), (0, "SEND_ACT", 0, 1), (0, "B", 0, None),
        (1, "RECV_ACT", 0, 0), (1, "F", 0, None), (1, "B", 0, None), (1, "SEND_GRAD", 0, 0),
    ]
    rows_ok_structure = _table(rows)
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at action #1 RECV_GRAD\(mb=0, from rank 1\); "
                                            r"rank 1 waits at action #0 RECV_ACT"):
        validate(rows_ok_structure)


def test_out_of_order_messages_are_caught():
    base = make_schedule("gpipe", stages=2, microbatches=2)
    r1 = list(base.actions[1])
    # Rank 1 receives microbatch 1 before microbatch 0, but rank 0 sends 0 first.
    i0 = r1.index(Action("RECV_ACT", 0, 0, 0))
    i1 = r1.index(Action("RECV_ACT", 1, 0, 0))
    r1[i0], r1[i1] = r1[i1], r1[i0]
    f0, f1 = r1.index(Action("F", 0)), r1.index(Action("F", 1))
    r1[f0], r1[f1] = r1[f1], r1[f0]
    from dataclasses import replace
    swapped = replace(base, actions=(base.actions[0], tuple(r1)))
    # Messages carry tags on gloo: rank 1 just waits for microbatch 1's message. Without tags (NCCL
    # unbatched) it would get microbatch 0's activations instead.
    validate(swapped)
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 RECV_ACT\(mb=1, from rank 0\): would receive "
                                            r"SEND_ACT\(mb=0, to rank 1\)"):
        validate(swapped, ordered=True)
    # The batched NCCL plan posts rank 1's receives in rank 0's send order, so it pairs them right.
    from mlmkit.pipeline.batching import plan_batches
    plan = plan_batches(swapped)
    recv_order = [swapped.actions[1][i].microbatch for st in plan.steps[1] for i in st.actions
                  if swapped.actions[1][i].kind == "RECV_ACT"]
    assert recv_order == [0, 1]


def test_wrong_peer_and_unknown_kind():
    rows = list(GOOD)
    rows[1] = (0, "SEND_ACT", 0, 0)
    with pytest.raises(ScheduleError, match=r"rank 0, action #1 SEND_ACT\(mb=0, to rank 0\): peer should be rank 1"):
        validate(_table(rows))
    with pytest.raises(ScheduleError, match="unknown action kind 'FWD'"):
        _table([(0, "FWD", 0, None)])


LOCAL_HANDOFFS = [("zb-v", p, m, 2) for p in (1, 2, 4) for m in (p, 2 * p + 1)] + \
    [("dualpipev", p, m, 2) for p in (1, 2, 4) for m in (2 * p, 2 * p + 2)] + \
    [("interleaved-1f1b", 1, m, v) for m in (2, 5) for v in (2, 3)]


@pytest.mark.parametrize("name,p,m,v", LOCAL_HANDOFFS)
def test_a_handoff_in_memory_out_of_order_is_named(name, p, m, v):
    # Neighbouring virtual stages on one rank (the tip of a V; every stage when p=1) hand over
    # without a message, so no receive waits for the producer: the dry run cannot see the order.
    # Each consumer moved to just before its producer (every such pair, every microbatch) is
    # refused with the pair named; the executor would otherwise fail on one rank mid-step, and
    # simulate() would time a step no run can have.
    from dataclasses import replace
    base = validate(make_schedule(name, stages=p, microbatches=m, chunks=v, layers=12))
    moved = 0
    for r in range(p):
        for c in range(v):
            vs = base.virtual_stage(r, c)
            if vs == 0 or base.rank_of(vs - 1)[0] != r:
                continue
            low = base.rank_of(vs - 1)[1]
            for mb in range(m):
                acts = list(base.actions[r])
                back = lambda chunk: next(a for a in acts if a.kind in "BI" and (a.microbatch, a.chunk) == (mb, chunk))
                for consumer, producer, what in ((Action("F", mb, c), Action("F", mb, low), "forward"),
                                                 (back(low), back(c), "backward")):
                    order = [a for a in acts if a != consumer]
                    order.insert(order.index(producer), consumer)
                    bad = replace(base, actions=base.actions[:r] + (tuple(order),) + base.actions[r + 1:])
                    with pytest.raises(ScheduleError, match=rf"rank {r}, action #{order.index(consumer)} "
                                                            rf"{consumer.kind}\(mb={mb}(, chunk=\d)?\): {what} of "
                                                            rf"microbatch {mb}, chunk \d before the {what} .*hand over "
                                                            rf"in memory"):
                        validate(bad)
                    with pytest.raises(ScheduleError, match="in memory"):
                        simulate(bad, UNIFORM)
                    moved += 1
    assert moved == 2 * m * (v - 1 if p == 1 else 1)          # one pair per rank at a V's tip, v - 1 on one rank


def test_compute_only_table_gets_communication():
    rows = [{"rank": r, "kind": k, "microbatch": mb} for r in (0, 1) for k, mb in (("F", 0), ("F", 1), ("B", 0), ("B", 1))]
    s = schedule_from_table(rows, add_communication=True)
    validate(s)
    assert s.to_frame().kind.value_counts()["SEND_ACT"] == 2


def test_planning_layer_is_pure():
    import subprocess
    import sys

    code = ("import sys, mlmkit.pipeline; "
            "bad=[m for m in sys.modules if m.startswith('torch')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", SCHEDULES)
def test_cursor_steps_every_schedule_to_the_end_without_blocking(name):
    from mlmkit.pipeline import ScheduleCursor

    s = make_schedule(name, stages=4, microbatches=8, chunks=_chunks(name))
    cur = ScheduleCursor(s)
    rounds = 0
    while not cur.done:
        ready = cur.runnable()
        assert ready, f"stuck at {cur}"
        for r in ready:
            cur.advance(r)
        rounds += 1
    assert rounds >= max(len(a) for a in s.actions) // 2
    blocked = ScheduleCursor(make_schedule("gpipe", stages=2, microbatches=1))
    assert blocked.runnable() == [0]  # rank 1 starts with a receive nobody has sent yet
    with pytest.raises(RuntimeError, match="rank 1 cannot take RECV_ACT"):
        blocked.advance(1)


def _feeds(s, rank, a):
    """(rank, index) of the receive that the send ``a`` of ``rank`` feeds, found by virtual stages."""
    vs = s.virtual_stage(rank, a.chunk)
    dst, kind = (vs + 1, "RECV_ACT") if a.kind == "SEND_ACT" else (vs - 1, "RECV_GRAD")
    r, c = s.rank_of(dst)
    (i,) = [i for i, b in enumerate(s.actions[r]) if b.kind == kind and b.microbatch == a.microbatch and b.chunk == c]
    return r, i


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12), (8, 16)])
def test_cursor_lets_a_receive_go_only_after_its_own_message_was_sent(name, p, m):
    # The lockstep driver of a notebook session steps a rank's receive only when it cannot block.
    # On gloo each message carries a tag, so the receive waits for one message: the send of the same
    # microbatch from the neighbouring virtual stage. With V placements a channel carries activations
    # and gradients in another order than they are received (zb-v at pp=4); a cursor that counted
    # messages per pair of ranks let rank 3 receive before its message left, and the engine hung.
    from mlmkit.pipeline import ScheduleCursor

    if name == "dualpipev" and m < 2 * p:
        return
    s = make_schedule(name, stages=p, microbatches=m, chunks=_chunks(name))
    sent_at = {}
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind.startswith("SEND"):
                sent_at[_feeds(s, r, a)] = None
    cur, clock = ScheduleCursor(s), 0
    while not cur.done:
        ready = cur.runnable()
        assert ready, f"stuck at {cur}"
        for r in ready:
            i = cur.index[r]
            a = cur.advance(r)
            if a.kind.startswith("SEND"):
                sent_at[_feeds(s, r, a)] = clock
            elif a.kind.startswith("RECV"):
                assert sent_at[(r, i)] is not None and sent_at[(r, i)] < clock, (r, i, a)
        clock += 1


# ----------------------------------------------------------------------------- fewer microbatches than stages
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 2), (4, 3), (8, 5)])
def test_fewer_microbatches_than_stages_run_with_a_note(name, p, m):
    # Megatron-LM runs 1F1B with m < p: every microbatch is in warm-up. The generator's order is
    # valid there (each rank: all forwards, then all backwards), and the schedule says the bubble is large.
    s = validate(make_schedule(name, stages=p, microbatches=m))
    assert s.notes and "bubble is large" in s.notes[0] and f"microbatches={m} < stages={p}" in s.notes[0]
    assert "note:" in str(s) and "note:" in s._repr_html_()
    res = simulate(s, UNIFORM if name == "1f1b" else {"forward": 1.0, "backward": 1.0, "weight": 1.0})
    if name == "1f1b":
        assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    for r in range(p):
        f = [a.microbatch for a in s.compute_actions(r) if a.kind == "F"]
        assert f == list(range(m))
    assert not make_schedule(name, stages=p, microbatches=p).notes


# ----------------------------------------------------------------------------- batched p2p (NCCL semantics)
def _all_generated(max_p=8):
    for name in SCHEDULES:
        for p in (2, 3, 4, max_p):
            for m in (range(1, 4 * p + 1) if p < max_p else (p - 1, p, p + 1, 2 * p, 2 * p + 3, 4 * p)):
                try:
                    yield make_schedule(name, stages=p, microbatches=m, chunks=_chunks(name))
                except ScheduleError:
                    continue


def test_natural_batching_deadlocks_where_the_issue_says():
    # The old rule (each run of consecutive communication actions is one batch) under NCCL's semantics:
    # interleaved 1F1B deadlocks exactly when m > p, which plain validation (non-blocking sends) passed.
    from mlmkit.pipeline.batching import check_batches, natural_batches

    deadlocked, mispaired_v = set(), set()
    for s in _all_generated():
        validate(s)
        try:
            check_batches(s, natural_batches(s))
        except ScheduleError as err:
            if s.placement == "v":     # the V schedules: activations and gradients share channels
                mispaired_v.add(s.name)
                continue
            assert "deadlock with batched communication" in str(err)
            deadlocked.add((s.name, s.stages, s.microbatches))
    expected = {("interleaved-1f1b", p, m) for p in (2, 3, 4, 8) for m in range(2 * p, 4 * p + 1, p)}
    assert deadlocked == {x for x in expected if x != ("interleaved-1f1b", 8, 24)}   # m=24 at p=8: not generated here
    assert mispaired_v == {"zb-v", "dualpipev"}     # the old rule fails them too; the plan does not


def test_batch_plan_of_every_generated_schedule_completes():
    from mlmkit.pipeline.batching import BatchCursor, check_batches, plan_batches

    count = 0
    for s in _all_generated():
        plan = validate(s, batched=True) and plan_batches(s)
        check_batches(s, [[list(st.actions) for st in steps] for steps in plan.steps])
        for r in range(s.stages):
            # every action exactly once; receives of a channel in the sender's order
            assert sorted(i for st in plan.steps[r] for i in st.actions) == list(range(len(s.actions[r])))
            # a compute action never comes before the receive that feeds it
            seen = set()
            for st in plan.steps[r]:
                for i in st.actions:
                    a = s.actions[r][i]
                    seen.add((a.kind, a.microbatch, a.chunk))
                    vs = s.virtual_stage(r, a.chunk)
                    if a.kind == "F" and vs > 0 and s.rank_of(vs - 1)[0] != r:
                        assert ("RECV_ACT", a.microbatch, a.chunk) in seen
                    if a.kind in ("B", "I") and vs < s.virtual_stages - 1 and s.rank_of(vs + 1)[0] != r:
                        assert ("RECV_GRAD", a.microbatch, a.chunk) in seen
        # Lockstep rounds: every rank takes at most one step per round and everything runs.
        cur = BatchCursor(plan)
        while not cur.done:
            assert cur.advance_round()
        count += 1
    assert count > 150


def test_batched_semantics_catch_a_swapped_pair_without_tags():
    # pp=2 interleaved: rank 1 receives activations (chunk 0, from virtual stage 0) and gradients (chunk 0,
    # from virtual stage 2) from rank 0 on one channel, all of one shape. Posting two of them in the other
    # order than rank 0 sends them would swap them silently under NCCL; the model names it.
    from mlmkit.pipeline.batching import check_batches, plan_batches

    s = make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    plan = plan_batches(s)
    batches = [[list(st.actions) for st in steps] for steps in plan.steps]
    acts = s.actions[1]
    recvs = [(k, i) for k, steps in enumerate(batches[1]) for i in steps if acts[i].kind.startswith("RECV")]
    kinds = {acts[i].kind for _, i in recvs}
    assert kinds == {"RECV_ACT", "RECV_GRAD"}            # both kinds travel on the one channel 0 -> 1
    # Take the first activation receive that is followed by a gradient receive; post the gradient first.
    for (k1, i1), (k2, i2) in zip(recvs, recvs[1:]):
        if acts[i1].kind == "RECV_ACT" and acts[i2].kind == "RECV_GRAD":
            break
    batches[1][k2].remove(i2)
    batches[1][k1].insert(batches[1][k1].index(i1), i2)
    batches[1] = [b for b in batches[1] if b]
    with pytest.raises(ScheduleError, match="instead of the message it expects"):
        check_batches(s, batches)


def test_interleaved_microbatch_groups_follow_megatron():
    # Megatron-LM's documented table for PP2 N3 M5 VP2: microbatch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1.
    s = make_schedule("interleaved-1f1b", stages=2, microbatches=5, chunks=2, microbatch_group=3)
    forwards = [(a.microbatch, a.chunk) for a in s.compute_actions(0) if a.kind == "F"]
    assert forwards == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    validate(s, batched=True)
    # With the default group (p) and p dividing m, the order is the classic one: bubble (p-1)/(v m).
    for p, m in [(2, 4), (4, 8)]:
        res = simulate(make_schedule("interleaved-1f1b", stages=p, microbatches=m, chunks=2), UNIFORM)
        assert res.bubble_ratio == pytest.approx((p - 1) / (2 * m))


def test_table_rows_as_tuples_are_five_long_or_three():
    rows = [(0, "F", 0, 0, None), (0, "RECV_GRAD", 0, 0, 1), (0, "SEND_ACT", 0, 0, 1), (0, "B", 0, 0, None),
            (1, "RECV_ACT", 0, 0, 0), (1, "F", 0, 0, None), (1, "B", 0, 0, None), (1, "SEND_GRAD", 0, 0, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(schedule_from_table(rows))
    # (rank, kind, microbatch, peer) would silently read the peer as a chunk: refused, with the fix.
    with pytest.raises(ScheduleError, match=r"has 4 entries: a tuple row is \(rank, kind, microbatch\) or"):
        schedule_from_table([(r, k, mb, peer) for r, k, mb, _, peer in rows])


def test_a_dataframe_of_actions_reads_blanks_as_defaults_and_refuses_fractions():
    # A DataFrame writes a blank cell as NaN and a column of whole numbers with blanks as floats. A
    # blank chunk failed with "cannot convert float NaN to integer"; microbatch 0.5 or peer 1.5 were
    # cut to 0 and 1 without a word. Every generator's schedule reads back from its table.
    for name in SCHEDULES:
        chunks = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
        sched = make_schedule(name, stages=2, microbatches=4, chunks=chunks)
        rows = [dict(rank=r, kind=a.kind, microbatch=a.microbatch, chunk=a.chunk if a.chunk else None, peer=a.peer)
                for r in range(2) for a in sched.actions[r]]
        table = pd.DataFrame(rows)
        assert table.chunk.isna().any() and table.peer.dtype == float
        back = schedule_from_table(table, stages=2, microbatches=4, chunks=chunks, placement=sched.placement)
        assert back.actions == sched.actions, name
    table = pd.DataFrame([dict(rank=a[0], kind=a[1], microbatch=a[2], peer=a[3]) for a in GOOD])
    for column, values, needle in (("microbatch", [0, 0, 0, 0.5, 0, 0, 0, 0], r"row 3: microbatch=0.5 is not a whole"),
                                   ("peer", [None, 1.5, 1, None, 0, None, None, 0], r"row 1: peer=1.5 is not a whole"),
                                   ("rank", [0, 0, 0, 0, 1, 1, None, 1], r"row 6: rank is blank"),
                                   ("chunk", [0, 0, 0, float("inf"), 0, 0, 0, 0], r"row 3: chunk=inf is not a whole")):
        with pytest.raises(ScheduleError, match=needle):
            schedule_from_table(table.assign(**{column: values}))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"])
def test_simulate_fast_engine_equals_the_reference_dry_run(name):
    # simulate() runs its own compute-only engine (integer message names, columns); it must give the
    # reference dry run's timeline action for action, with uneven costs per rank and a message cost.
    from mlmkit.pipeline.simulate import dry_run

    chunks = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
    for stages, m in ((2, 4), (4, 8), (3, 6)):
        if name == "interleaved-1f1b" and m % stages:
            continue
        s = make_schedule(name, stages=stages, microbatches=m, chunks=chunks)
        costs = Costs(forward=[1.0 + 0.3 * r for r in range(stages)], backward=2.5, weight=0.7, p2p_latency=0.4)
        ref = [(r, a.kind, a.microbatch, a.chunk, t0, t1) for r, _, a, t0, t1 in dry_run(s, costs, compute_only=True)]
        got = simulate(s, costs).timeline
        mine = list(zip(got["rank"], got["action"], got["microbatch"], got["chunk"], got["start"], got["end"]))
        assert sorted(mine) == sorted(ref), (name, stages, m)


def test_simulate_and_replay_agree_with_the_dry_run_on_random_valid_orders():
    # Beside the six generators: random valid schedules (any order the validator accepts, drawn one
    # ready action at a time; loops of 1-3 chunks and Vs, fused and split backwards, 2-4 stages) are
    # valid on both communication paths, the fast engine gives the reference dry run's timeline, a
    # replay of it gives it back, and sharing fewer cores than ranks is never faster than the work
    # allows. 1,500 seeds passed.
    import random

    from mlmkit.pipeline import replay
    from mlmkit.pipeline.simulate import dry_run

    from random_schedules import random_schedule

    for seed in range(300):
        rng = random.Random(seed)
        p = rng.choice([2, 3, 4])
        chunks, placement = rng.choice([(1, "loop"), (2, "loop"), (2, "v"), (3, "loop")])
        m = rng.choice([1, 2, 3, p, 2 * p + 1])
        s = random_schedule(seed, stages=p, microbatches=m, chunks=chunks, placement=placement,
                            split=rng.choice([0.0, 0.5, 1.0]), eager=rng.random())
        validate(s, batched=True)
        costs = Costs(forward=[1.0 + 0.3 * r for r in range(p)], backward=2.5, weight=0.7,
                      p2p_latency=rng.choice([0.0, 0.4]))
        ref = [(r, a.kind, a.microbatch, a.chunk, t0, t1) for r, _, a, t0, t1 in dry_run(s, costs, compute_only=True)]
        sim = simulate(s, costs)
        got = sim.timeline
        mine = list(zip(got["rank"], got["action"], got["microbatch"], got["chunk"], got["start"], got["end"]))
        assert sorted(mine) == sorted(ref), seed
        assert replay(got, s, p2p_latency=costs.p2p_latency).step_time == pytest.approx(sim.step_time), seed
        work = sum(sim.busy_per_rank.values())
        for cores in (1, 1.5):
            assert simulate(s, costs, cores=cores).step_time >= max(sim.step_time, work / cores) - 1e-9, (seed, cores)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"])
def test_replay_of_a_timeline_reproduces_it_and_never_beats_a_slower_run(name):
    # replay() re-runs a schedule with each action's own time from a timeline. Fed a simulated
    # timeline (uneven costs per rank and a message cost) with the same message cost, it gives that
    # simulation back exactly; with free messages it is never slower (what the measured bubble beyond
    # the replay's is: messages and waits).
    from mlmkit.pipeline import replay

    chunks = _chunks(name)
    for stages, m in ((2, 4), (4, 8), (3, 6)):
        if name == "interleaved-1f1b" and m % stages:
            continue
        s = make_schedule(name, stages=stages, microbatches=m, chunks=chunks)
        costs = Costs(forward=[1.0 + 0.3 * r for r in range(stages)], backward=2.5, weight=0.7, p2p_latency=0.4)
        sim = simulate(s, costs)
        again = replay(sim.timeline, s, p2p_latency=0.4)
        assert again.step_time == pytest.approx(sim.step_time) and again.bubble_fraction == pytest.approx(sim.bubble_fraction)
        assert again.timeline.sort_values(["rank", "start"]).reset_index(drop=True).equals(
            sim.timeline.sort_values(["rank", "start"]).reset_index(drop=True))
        free = replay(sim.timeline, s)
        assert free.step_time < sim.step_time and free.busy_per_rank == pytest.approx(sim.busy_per_rank)
        # Per-action times, not per-kind: stretching one microbatch's forward on the last rank
        # stretches the replayed step by exactly what the simulation with that time says.
        tl = sim.timeline.copy()
        last = (tl["rank"] == stages - 1) & (tl.action == "F") & (tl.microbatch == m - 1) & (tl.chunk == 0)
        tl.loc[last, "end"] += 5.0
        assert replay(tl, s, p2p_latency=0.4).step_time > sim.step_time


def test_replay_refuses_a_timeline_that_is_not_one_step_of_the_schedule():
    from mlmkit.pipeline import replay

    s = make_schedule("1f1b", stages=2, microbatches=4)
    tl = simulate(s, UNIFORM).timeline
    with pytest.raises(ValueError, match=r"two rows for \(0, 'F', 0, 0\).*first tp rank of each stage"):
        replay(tl.iloc[[0] + list(range(len(tl)))], s)
    with pytest.raises(ValueError, match=r"has 15 compute actions, the schedule 16"):
        replay(tl.iloc[1:], s)
    with pytest.raises(ValueError, match=r"ranks=\[0, 2, 4\] name 3 stages, the schedule has 2"):
        replay(tl, s, ranks=[0, 2, 4])
    # Global ranks of one pipeline (tp=2: ranks 1 and 3), the other pipeline's rows left out.
    both = pd.concat([tl.assign(rank=tl["rank"] * 2 + 1), tl.assign(rank=tl["rank"] * 2, end=tl.end + 9.0)])
    assert replay(both, s, ranks=[1, 3]).step_time == pytest.approx(simulate(s, UNIFORM).step_time)
    # A pipeline's ranks given in the wrong order, or another schedule's timeline: refused by name
    # (every key exists on both ranks, so it would otherwise replay with the wrong times).
    with pytest.raises(ValueError, match=r"pipeline rank 0's compute action #1 in the timeline is \('B', 0, 0\), "
                                         r"the schedule's is \('F', 1, 0\)"):
        replay(both, s, ranks=[3, 1])
    gpipe = simulate(make_schedule("gpipe", stages=2, microbatches=4), UNIFORM).timeline
    with pytest.raises(ValueError, match=r"pipeline rank 0's compute action #2"):
        replay(gpipe, s)
    # Without ranks=, a tp peer's rows would pass for another stage's: refused, with the fix.
    with pytest.raises(ValueError, match=r"replay: the timeline has rows of rank\(s\) \[2, 3\].*pass ranks="):
        replay(both, s)
    moved = tl.assign(microbatch=tl.microbatch.where(tl.microbatch != 3, 7))
    with pytest.raises(ValueError, match=r"compute action #5 in the timeline is \('F', 7, 0\), the schedule's is \('F', 3, 0\)"):
        replay(moved, s)
    from mlmkit.pipeline import ActionCosts
    with pytest.raises(ValueError, match=r"no measured time for rank 0's F\(mb=1\) \(key \(0, 'F', 1, 0\)\)"):
        simulate(s, ActionCosts(times={(0, "F", 0, 0): 1.0}))


def test_calibrate_takes_one_pipeline_and_refuses_other_ranks():
    # A tp=2 trace has 4 ranks for 2 stages: rank 1 is stage 0's tp peer, not stage 1. calibrate()
    # once read it as stage 1 and silently priced stage 1 with stage 0's times.
    from mlmkit.pipeline.simulate import calibrate

    s = make_schedule("1f1b", stages=2, microbatches=4)
    tl = simulate(s, Costs(forward=[1.0, 3.0], backward=[2.0, 5.0])).timeline
    four = pd.concat([tl.assign(rank=tl["rank"] * 2), tl.assign(rank=tl["rank"] * 2 + 1)])   # tp=2 x pp=2 ranks
    with pytest.raises(ValueError, match=r"calibrate: the timeline has rows of rank\(s\) \[2, 3\]"):
        calibrate(four, s)
    costs = calibrate(four, s, ranks=[0, 2])
    assert costs.forward == [1.0, 3.0] and costs.backward == [2.0, 5.0]
    assert calibrate(tl, s).forward == [1.0, 3.0]
    # A set of ranks has no stage order: {0, 4, 8, 12} iterates 0, 8, 4, 12, and calibrate() priced
    # stage 1 with stage 2's times without a word. Refused, as in replay() and timeline_comparison().
    s4 = make_schedule("1f1b", stages=4, microbatches=4)
    tl4 = simulate(s4, Costs(forward=[1.0, 2.0, 3.0, 4.0], backward=2.0)).timeline
    wide = tl4.assign(rank=tl4["rank"] * 4)                        # tp=4: pipeline 0 is ranks 0, 4, 8, 12
    assert calibrate(wide, s4, ranks=[0, 4, 8, 12]).forward == [1.0, 2.0, 3.0, 4.0]
    from mlmkit.pipeline import replay

    for call in (lambda r: calibrate(wide, s4, ranks=r), lambda r: replay(wide, s4, ranks=r)):
        for unordered in ({0, 4, 8, 12}, frozenset({0, 4, 8, 12}), {0: 0, 4: 1, 8: 2, 12: 3}):
            with pytest.raises(ValueError, match=r"is unordered; give one pipeline's global ranks as a list"):
                call(unordered)


def test_calibrate_takes_each_stages_statistic_of_each_kind():
    # Measured durations of one kind on one virtual stage, with an outlier (a slow first action), give
    # their median, mean or minimum as asked; the split backward's I and W are read apart, and a full
    # B without W is the backward.
    from mlmkit.pipeline.simulate import calibrate

    s = make_schedule("zb-h1", stages=2, microbatches=4)
    tl = simulate(s, Costs(forward=[1.0, 2.0], backward=[3.0, 4.0], weight=[0.5, 0.25])).timeline
    first = tl[(tl["rank"] == 0) & (tl.action == "F")].sort_values("microbatch")
    tl = tl.copy()
    tl.loc[first.index, "end"] = first.start.to_numpy() + [1.0, 1.0, 1.5, 9.0]   # stage 0's four forwards
    for statistic, want in (("median", 1.25), ("mean", 3.125), ("min", 1.0)):
        costs = calibrate(tl, s, statistic=statistic)
        assert costs.forward == [pytest.approx(want), pytest.approx(2.0)], statistic
        assert costs.backward == [3.0, 4.0] and costs.weight == [0.5, 0.25], statistic
    full = simulate(make_schedule("1f1b", stages=2, microbatches=4), Costs(forward=1.0, backward=[3.0, 4.0],
                                                                          weight=[0.5, 0.25])).timeline
    costs = calibrate(full, make_schedule("1f1b", stages=2, microbatches=4))
    assert costs.backward == [3.5, 4.25] and costs.weight == [0.0, 0.0]
