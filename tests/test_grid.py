"""The one layout of ranks, dp x pp x tp (`ringtrain.grid`): pure index math, no processes.

    .venv/bin/pytest -q tests/test_grid.py

The process groups themselves are made by every multi-rank pipeline and tp test
(tests/test_pipeline.py, tests/test_tp_strategy.py, tests/test_grid_equivalence.py).
"""

import pytest

from ringtrain.grid import Coords, Grid


def test_unit_tp_is_innermost_then_pp_then_dp():
    g = Grid(8, pp=2, tp=2)
    assert g.dp == 2
    assert [g.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert g.coords(5) == Coords(dp_rank=1, pp_rank=0, tp_rank=1)
    assert all(g.rank_of(*g.coords(r)) == r for r in range(8))
    groups = g.groups()
    # tp: consecutive ranks (one host); a pipeline: one tp rank of every stage; dp: one slice
    # of one stage in every replica.
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world, pp, tp", [(8, 2, 2), (12, 3, 2), (12, 2, 3), (6, 1, 3),
                                           (6, 3, 1), (4, 1, 1), (16, 2, 4)])
def test_unit_each_axis_partitions_the_world_and_the_axes_meet_once(world, pp, tp):
    g = Grid(world, pp=pp, tp=tp)
    groups = g.groups()
    for axis, size in (("dp", g.dp), ("pp", pp), ("tp", tp)):
        flat = sorted(r for group in groups[axis] for r in group)
        assert flat == list(range(world)), axis  # every rank in exactly one group per axis
        assert all(len(group) == size for group in groups[axis]), axis
    for r in range(world):
        c = g.coords(r)
        assert g.tp_group_ranks(c.dp_rank, c.pp_rank)[c.tp_rank] == r
        assert g.pp_group_ranks(c.dp_rank, c.tp_rank)[c.pp_rank] == r
        assert g.dp_group_ranks(c.pp_rank, c.tp_rank)[c.dp_rank] == r
        # Two ranks share a group of two axes only if they are the same rank.
        mine = [set(next(x for x in groups[a] if r in x)) for a in ("dp", "pp", "tp")]
        assert all(a & b == {r} for i, a in enumerate(mine) for b in mine[i + 1:])


def test_unit_the_two_dimensional_layouts_are_views_of_it():
    # dp x pp (--strategy pipeline): stages of one pipeline are adjacent ranks.
    t = Grid(8, pp=4)
    assert [t.coords(r)[:2] for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert t.pp_group_ranks(1) == [4, 5, 6, 7] and t.dp_group_ranks(2) == [2, 6]
    assert Grid(3, pp=1).dp_group_ranks(0) == [0, 1, 2]
    # dp x tp (--strategy tp): a replica's tp ranks are consecutive.
    g = Grid(4, tp=2)
    assert g.dp == 2 and (g.coords(3).dp_rank, g.coords(3).tp_rank) == (1, 1)
    assert g.tp_group_ranks(1) == [2, 3] and g.dp_group_ranks(0) == [0, 2]


def test_unit_a_world_it_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"world_size=3 is not divisible by pp=2"
                                         r".*--nproc-per-node 2 or 4.*--pp in \[1, 3\]"):
        Grid(3, pp=2)
    with pytest.raises(ValueError, match="world_size=2 is not divisible by pp=4"):
        Grid(2, pp=4)
    with pytest.raises(ValueError, match=r"world_size=3 is not divisible by tp=2.*--tp in \[1, "):
        Grid(3, tp=2)
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by pp=2 x tp=2.*"
                                         r"--nproc-per-node 4 or 8 .*--pp and --tp whose product"):
        Grid(6, pp=2, tp=2)
    with pytest.raises(ValueError, match="Invalid rank 8"):
        Grid(8, pp=4).coords(8)
    with pytest.raises(ValueError, match="outside dp=1 x pp=2 x tp=2"):
        Grid(4, pp=2, tp=2).rank_of(0, 2, 0)
    with pytest.raises(TypeError):  # the degrees are keywords: Grid(4, 2) says neither
        Grid(4, 2)  # type: ignore[misc]
