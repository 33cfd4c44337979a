"""The rank grid: Megatron-LM's order, groups of every kind (checked against Megatron-Core's rank
generator), round trips and bad input."""

import itertools
import json
import os

import pytest

from mlmkit import Topology
from mlmkit.topology import GROUP_KINDS

SHAPES = [(1, 1, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4), (3, 2, 2), (1, 8, 1)]


def test_megatron_order_tp2_pp2_dp2():
    topo = Topology(tp=2, pp=2, dp=2)
    assert topo.world_size == 8
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp4_pp2_dp1():
    topo = Topology(tp=4, pp=2, dp=1)
    assert topo.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.groups("dp") == [[r] for r in range(8)]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.coords(6) == (2, 0, 0, 1)


def test_tp1_pp4_dp2():
    topo = Topology(tp=1, pp=4, dp=2)
    assert topo.groups("tp") == [[r] for r in range(8)]
    assert topo.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.groups("embedding") == [[0, 6], [1, 7]]
    assert topo.coords(5) == (0, 0, 1, 2)


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_round_trip_and_partition(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert topo.rank(tp=c.tp, dp=c.dp, pp=c.pp) == rank
        seen.add(c)
    assert len(seen) == topo.world_size
    for kind, degree in (("tp", tp), ("cp", 1), ("dp", dp), ("pp", pp)):
        groups = topo.groups(kind)
        assert sorted(itertools.chain(*groups)) == list(range(topo.world_size))
        assert all(len(g) == degree for g in groups)
        # Members of one group differ only along that axis.
        for g in groups:
            coords = [topo.coords(r) for r in g]
            for other in set(("tp", "cp", "dp", "pp")) - {kind}:
                assert len({getattr(c, other) for c in coords}) == 1
            assert [getattr(c, kind) for c in coords] == list(range(degree))
    for g in topo.groups("embedding"):
        stages = [topo.coords(r).pp for r in g]
        assert stages == ([0] if pp == 1 else [0, pp - 1])


def test_display_and_frame():
    topo = Topology(tp=2, pp=2, dp=2)
    df = topo.to_frame()
    assert list(df.index) == list(range(8))
    assert df.loc[5, "tp_group"] == [4, 5] and df.loc[5, "pp"] == 1
    assert "Topology(tp=2, pp=2, dp=2)" in topo._repr_html_()
    assert "stage pp=1" in str(topo)


def test_ranks_and_degrees_from_a_dataframe_are_integers():
    # A DataFrame's index and columns are numpy integers: rank np.int64(3) was refused as "out of
    # range ... expected an integer in [0, 3]", Topology(tp=np.int64(2)) as "not an integer".
    import numpy as np

    topo = Topology(tp=np.int64(2), pp=np.int64(2), dp=np.int64(2))
    assert topo == Topology(tp=2, pp=2, dp=2) and type(topo.tp) is int
    frame = topo.to_frame()
    for rank in frame.index.to_numpy():
        coords = topo.coords(rank)
        assert coords == topo.coords(int(rank)) and all(type(c) is int for c in coords)
        assert topo.rank(tp=np.int64(coords.tp), dp=np.int64(coords.dp), pp=np.int64(coords.pp)) == rank
        assert topo.group_of("tp", rank) == frame.loc[int(rank), "tp_group"]
    with pytest.raises(ValueError, match=r"rank np.int64\(8\) is out of range"):
        topo.coords(np.int64(8))


@pytest.mark.parametrize("kwargs,needle", [
    ({"tp": 0}, "tp=0"), ({"pp": -2}, "pp=-2"), ({"dp": 1.5}, "dp=1.5"), ({"tp": "2"}, "tp='2'"),
    ({"dp": True}, "dp=True"),
])
def test_bad_degrees(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        Topology(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        Topology(2, 2, 2)  # keyword-only: tp/pp/dp order is too easy to mix up


def test_world_size_mismatch():
    with pytest.raises(ValueError, match=r"world size 6 .*tp\*cp\*dp\*pp = 2\*1\*2\*2 = 8"):
        Topology(tp=2, pp=2, dp=2).check_world_size(6)


@pytest.mark.parametrize("rank", [-1, 8, 2.0, None])
def test_rank_out_of_range(rank):
    with pytest.raises(ValueError, match=r"rank .* out of range.*\[0, 7\]"):
        Topology(tp=2, pp=2, dp=2).coords(rank)


def test_coordinate_out_of_range():
    with pytest.raises(ValueError, match=r"pp=2 is out of range.*\[0, 1\]"):
        Topology(tp=2, pp=2, dp=2).rank(pp=2)


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown group kind 'xp'.*'tp', 'cp', 'dp', 'pp', 'dp-cp'"):
        Topology(tp=2).groups("xp")
    with pytest.raises(ValueError, match=r"unknown group kind 'tp-ep'"):
        Topology(tp=2).groups("tp-ep")          # ep lives on the expert grid: "expert-tp-ep"
    with pytest.raises(ValueError, match=r"unknown group kind 'dp-dp'"):
        Topology(tp=2).groups("dp-dp")
    for kind in GROUP_KINDS:
        Topology(tp=2, cp=2, dp=2, ep=2).groups(kind)


def test_planning_layer_imports_no_torch_distributed():
    import subprocess
    import sys

    code = ("import sys, mlmkit.topology; "
            "bad=[m for m in sys.modules if m.startswith('torch')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- against Megatron-Core
with open(os.path.join(os.path.dirname(__file__), "data", "megatron_rank_groups.json")) as _f:
    MEGATRON = json.load(_f)["shapes"]


@pytest.mark.parametrize("case", MEGATRON, ids=lambda c: "-".join(f"{k}{v}" for k, v in c["shape"].items()))
def test_groups_equal_megatron_core_rank_generator(case):
    """Every group kind equals what Megatron-Core 0.16.1's RankGenerator returns for the shape
    (recorded by tests/data/make_megatron_rank_groups.py; re-checked live when it is importable)."""
    topo = Topology(**case["shape"])
    for kind, groups in case["dense"].items():
        assert topo.groups(kind) == groups, kind
    expert_names = {"tp": "expert-tp", "ep": "ep", "dp": "expert-dp", "tp-ep": "expert-tp-ep", "tp-ep-pp": "expert-tp-ep-pp"}
    for kind, groups in case["expert"].items():
        assert topo.groups(expert_names[kind]) == groups, kind
    assert topo.groups("embedding") == [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in case["dense"]["pp"]]


def test_megatron_core_live_when_installed():
    rg = pytest.importorskip("megatron.core.parallel_state", reason="megatron-core not installed (the table covers it)")
    for tp, cp, dp, pp in [(2, 2, 2, 1), (1, 4, 2, 2), (2, 3, 1, 2)]:
        gen = rg.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp)
        for kind in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp"):
            assert topo.groups(kind) == gen.get_ranks(kind)


def test_context_parallel_grid():
    topo = Topology(tp=2, cp=2, dp=2, pp=2)
    assert topo.world_size == 16
    assert topo.coords(6) == (0, 1, 1, 0)
    assert topo.rank(tp=1, cp=1, dp=0, pp=1) == 11
    assert topo.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert topo.groups("dp-cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.size("dp-cp") == 4 and topo.size("tp-cp") == 4 and topo.size("embedding") == 2
    assert repr(topo) == "Topology(tp=2, cp=2, pp=2, dp=2)"
    df = topo.to_frame()
    assert df.loc[6, "dp_cp_group"] == [0, 2, 4, 6] and df.loc[6, "cp"] == 1
    assert "one block per cp rank" in str(topo)


def test_expert_grid_folds_dense_ranks():
    topo = Topology(tp=2, dp=2, pp=2, ep=4)          # per stage 4 dense ranks re-read as ep=4
    assert topo.expert_dp == 1
    assert topo.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.expert_coords(5) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"ep=3 x expert_tp=1 = 3 does not divide tp x cp x dp = 2x1x2 = 4.*choose ep in \[1, 2, 4\]"):
        Topology(tp=2, dp=2, ep=3)
    # No ep at all fits: the message names what would (it said "choose ep in []").
    with pytest.raises(ValueError, match=r"No ep fits expert_tp=2: make tp x cp x dp a multiple of 2 \(e.g. dp=2\)"):
        Topology(expert_tp=2)


def test_the_readme_tour_returns_what_its_comments_say():
    # README's tour shows values in comments ("topo.groups('tp')  # [[0, 1], ...]"); the pure lines
    # (before the cluster) are run here and each shown value compared, so the README stays true.
    import math
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## A tour of the library\s+```python\n(.*?)```", text, re.S).group(1)
    pure = block.split("from mlmkit.cluster")[0]
    scope, checked = {}, 0
    for line in pure.splitlines():
        code, _, comment = line.partition("  #")
        code, comment = code.strip(), comment.strip()
        if not code:
            continue
        head = re.split(r":| = | \(", comment, maxsplit=1)[0].strip() if comment else ""
        try:
            shown = eval(head, {"__builtins__": {}}) if head else None
        except (SyntaxError, NameError):
            shown = None
        if shown is None or code.startswith(("from ", "import ")) or "=" in code.split("(")[0]:
            exec(code, scope)
            continue
        value = eval(code, scope)
        assert (math.isclose(value, shown, rel_tol=1e-12) if isinstance(shown, float) else value == shown), \
            (code, value, comment)
        checked += 1
    assert checked == 3, checked
