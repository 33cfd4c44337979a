"""The rank grid: Megatron-LM's order, groups of every kind, round trips and bad input."""

import itertools

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
    assert topo.coords(6) == (2, 0, 1)


def test_tp1_pp4_dp2():
    topo = Topology(tp=1, pp=4, dp=2)
    assert topo.groups("tp") == [[r] for r in range(8)]
    assert topo.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.groups("embedding") == [[0, 6], [1, 7]]
    assert topo.coords(5) == (0, 1, 2)


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_round_trip_and_partition(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert topo.rank(tp=c.tp, dp=c.dp, pp=c.pp) == rank
        seen.add(c)
    assert len(seen) == topo.world_size
    for kind, degree in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = topo.groups(kind)
        assert sorted(itertools.chain(*groups)) == list(range(topo.world_size))
        assert all(len(g) == degree for g in groups)
        # Members of one group differ only along that axis.
        for g in groups:
            coords = [topo.coords(r) for r in g]
            for other in set(("tp", "dp", "pp")) - {kind}:
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
    with pytest.raises(ValueError, match=r"world size 6 .*tp\*pp\*dp = 2\*2\*2 = 8"):
        Topology(tp=2, pp=2, dp=2).check_world_size(6)


@pytest.mark.parametrize("rank", [-1, 8, 2.0, None])
def test_rank_out_of_range(rank):
    with pytest.raises(ValueError, match=r"rank .* out of range.*\[0, 7\]"):
        Topology(tp=2, pp=2, dp=2).coords(rank)


def test_coordinate_out_of_range():
    with pytest.raises(ValueError, match=r"pp=2 is out of range.*\[0, 1\]"):
        Topology(tp=2, pp=2, dp=2).rank(pp=2)


def test_unknown_axis():
    with pytest.raises(ValueError, match=r"unknown axis 'cp'.*'tp', 'dp', 'pp', 'embedding'"):
        Topology(tp=2).groups("cp")
    assert set(GROUP_KINDS) == {"tp", "dp", "pp", "embedding"}


def test_planning_layer_imports_no_torch_distributed():
    import subprocess
    import sys

    code = ("import sys, mlmkit.topology; "
            "bad=[m for m in sys.modules if m.startswith('torch')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
