"""The parameter-server shard plan: pure, no processes.

    .venv/bin/pytest -q tests/test_ps_sharding.py
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from ringtrain.ps.sharding import bucket_bounds, pack, plan_shards, unpack

SHAPES = [("emb", (50, 8)), ("w1", (8, 32)), ("b1", (32,)), ("w2", (32, 8)), ("b2", (8,)),
          ("ln", (8,)), ("head", (8, 50))]


def _coverage(plan):
    """name -> sorted list of (row_start, row_end) over every piece."""
    out: dict[str, list[tuple[int, int]]] = {}
    for p in plan.pieces:
        out.setdefault(p.name, []).append((p.row_start, p.row_end))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
@pytest.mark.parametrize("split_numel", [None, 100, 7])
def test_every_element_is_held_exactly_once(servers, split_numel):
    plan = plan_shards(SHAPES, servers, split_numel)
    cover = _coverage(plan)
    assert set(cover) == {n for n, _ in SHAPES}
    for name, shape in SHAPES:
        ranges = cover[name]
        assert ranges[0][0] == 0 and ranges[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, disjoint
    assert sum(plan.loads()) == sum(math.prod(s) for _, s in SHAPES)
    for s in range(servers):  # each server's flat buffer is packed without holes
        pieces = plan.for_server(s)
        assert [p.offset for p in pieces] == list(
            itertools.accumulate([0] + [p.numel for p in pieces[:-1]])
        )


def test_greedy_largest_first_balances_whole_tensors():
    # 400, 256, 256, 32, 8, 8, 400 -> LPT on 2 servers: {400, 256, 8, 8} vs {400, 256, 32}
    plan = plan_shards(SHAPES, 2, split_numel=None)
    assert sorted(plan.loads()) == [672, 688]
    assert all(p.row_start == 0 and p.shape == dict(SHAPES)[p.name] for p in plan.pieces)
    # No server is further above the ideal than the largest tensor (the LPT bound).
    assert max(plan.loads()) - sum(plan.loads()) / 2 <= 400


def test_large_tensors_are_split_into_row_chunks():
    plan = plan_shards([("big", (10, 100)), ("small", (4,))], 2, split_numel=300)
    big = [p for p in plan.pieces if p.name == "big"]
    assert [(p.row_start, p.row_end) for p in big] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert all(p.shape[1:] == (100,) and len(p.shape) == 2 for p in big)  # rank kept
    assert sorted(plan.loads()) == [500, 504]  # without splitting one server would hold 1000


def test_split_never_cuts_a_row():
    plan = plan_shards([("wide", (2, 1000))], 4, split_numel=10)
    assert [(p.row_start, p.row_end) for p in plan.pieces] == [(0, 1), (1, 2)]


def test_plan_is_deterministic_and_ties_go_to_the_lowest_server():
    a = plan_shards([("x", (4,)), ("y", (4,)), ("z", (4,))], 3, None)
    assert a == plan_shards([("x", (4,)), ("y", (4,)), ("z", (4,))], 3, None)
    assert [p.server for p in a.pieces] == [0, 1, 2]


def test_scalar_parameters():
    plan = plan_shards([("scale", ()), ("w", (3, 3))], 2, split_numel=1)
    assert sum(plan.loads()) == 10


@pytest.mark.parametrize("bad, match", [
    (dict(servers=0), "at least 1 server"),
    (dict(servers=2, split_numel=0), "split_numel=0"),
])
def test_bad_arguments_say_what_to_do(bad, match):
    with pytest.raises(ValueError, match=match):
        plan_shards(SHAPES, **bad)


def test_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match=r"repeated: \['w'\]"):
        plan_shards([("w", (2,)), ("w", (3,))], 1)


def test_pack_unpack_round_trip_through_every_server():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 3))
    named = dict(model.named_parameters())
    plan = plan_shards([(n, p.shape) for n, p in named.items()], 3, split_numel=50)
    flats = [pack(named, plan.for_server(s), torch.empty(plan.server_numel(s)))
             for s in range(3)]
    out = {n: torch.zeros_like(p) for n, p in named.items()}
    for s in range(3):
        unpack(flats[s], plan.for_server(s), out)
    for n, p in named.items():
        assert torch.equal(out[n], p.detach())


def test_pack_writes_zeros_for_a_missing_gradient():
    plan = plan_shards([("a", (2, 2)), ("b", (3,))], 1)
    flat = pack({"a": torch.ones(2, 2), "b": None}, plan.for_server(0), torch.full((7,), 9.0))
    assert flat.tolist() == [1, 1, 1, 1, 0, 0, 0]


def test_buckets_are_whole_pieces_about_the_cap():
    plan = plan_shards([("a", (10,)), ("b", (30,)), ("c", (5,)), ("d", (100,)), ("e", (1,))], 1)
    pieces = plan.for_server(0)
    assert bucket_bounds(pieces, 40) == [(0, 40), (40, 45), (45, 145), (145, 146)]
    assert bucket_bounds(pieces, 1000) == [(0, 146)]
    assert bucket_bounds(pieces, 1) == [(0, 10), (10, 40), (40, 45), (45, 145), (145, 146)]
    assert bucket_bounds((), 10) == []
    with pytest.raises(ValueError, match="bucket cap 0"):
        bucket_bounds(pieces, 0)
