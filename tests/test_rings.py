"""`ringtrain.rings` (send/recv rings on gloo) against their naive references, CPU, 2 and 3 ranks.

    .venv/bin/pytest -q tests/test_rings.py

ZeRO communicates with these rings, and tensor parallelism's sequence-parallel reduce-scatter on
gloo (tests/test_tensor_parallel.py checks that one through `comm.reduce_scatter`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain.rings import all_gather, all_gather_naive, reduce_scatter, reduce_scatter_naive
from ringtrain.testing import run_workers


def _collectives(rank, world_size):
    g = dist.group.WORLD
    torch.manual_seed(rank)
    x = torch.randn(world_size * 1001)
    out, ref = torch.empty(1001), torch.empty(1001)
    reduce_scatter(out, x, g).wait()
    reduce_scatter_naive(ref, x, g)
    in_place = x.clone()  # the output aliasing its own chunk of the input (ZeRO-1)
    chunk = in_place[rank * 1001:(rank + 1) * 1001]
    reduce_scatter(chunk, in_place, g).wait()
    full = torch.zeros(world_size * 1001)
    full[rank * 1001:(rank + 1) * 1001] = rank + 1
    other = full.clone()
    all_gather(full, g).wait()
    all_gather_naive(other, g)
    return {"rs": torch.allclose(out, ref, atol=1e-6), "alias": torch.equal(chunk, out),
            "ag": torch.equal(full, other) and full.view(world_size, -1)[:, 0].tolist()
            == [float(r + 1) for r in range(world_size)]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_equals_naive(world_size):
    """gloo, CPU: the ring reduce-scatter (apart from and inside its input) and all-gather equal
    all-reduce-then-slice and gloo's all_gather."""
    for r in run_workers(_collectives, world_size, timeout_s=60):
        assert r == {"rs": True, "alias": True, "ag": True}


def test_a_buffer_that_does_not_split_is_refused_with_the_fix():
    """No ranks: the shape check runs before any communication."""
    from ringtrain.rings import _check

    with pytest.raises(ValueError, match=r"multiple of world_size=2 elements; got shape \(5,\)"):
        _check(torch.empty(5), 2, "reduce_scatter")
