"""The profiler sees as many gradient all-reduces as with torch's DDP: one per bucket.

    .venv/bin/pytest -q tests/test_ddp_profiler.py

ringtrain checks unused parameters in every synced backward with a status every rank sums; it
rides in the last bucket's all-reduce (`buckets.status_carrier_last`) instead of an all-reduce
of its own, which had doubled torch's count in its own profiling test (issue 25: 12
`gloo:all_reduce` events for 6 iterations of one Linear, where torch shows 6). gloo, CPU, world
size 2, both DDPs under the same profiler (torch's _test_ddp_profiling, distributed_test.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.ddp.buckets import status_carrier_last
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.unused_params import UnusedParametersError
from ringtrain.testing import run_workers

CLASSES = {"ours": DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}


def _count(prof, suffix: str) -> tuple[int, bool]:
    events = [e for e in prof.function_events if e.name == f"gloo:{suffix}"]
    return len(events), all(e.is_async for e in events)


def _profiled(rank, world_size):
    out = {}
    models = {
        "linear": lambda: nn.Linear(10, 10, bias=False),  # torch's test: one 1-member bucket
        # A 1 MiB weight (a solo bucket, reduced in place) and small ones: two buckets.
        "mlp": lambda: nn.Sequential(nn.Linear(10, 512), nn.Linear(512, 512), nn.Linear(512, 10)),
    }
    for model_name, make in models.items():
        for which, cls in CLASSES.items():
            torch.manual_seed(0)
            net = cls(make())
            inp = torch.rand(3, 10)
            for _ in range(2):  # past the first iteration's bucket rebuild
                net(inp).sum().backward()
            with torch.autograd.profiler.profile() as prof:
                for _ in range(6):
                    net(inp).sum().backward()
                # gloo records an all-reduce's async event from its own thread as the work
                # ends, which can come after backward returned: torch's DDP showed 5 of its 6
                # once in 12 runs on torch 2.11 under load. The barrier (a gloo:barrier event,
                # not counted) waits for every earlier work of the group, inside the profiler.
                torch.distributed.barrier()
            out[model_name, which] = _count(prof, "all_reduce")
    for which, cls in CLASSES.items():
        torch.manual_seed(0)
        net = cls(nn.Linear(10, 10, bias=False), find_unused_parameters=True)
        for _ in range(3):
            net(torch.rand(3, 10)).sum().backward()
        with torch.autograd.profiler.profile() as prof:
            net(torch.rand(3, 10)).sum().backward()
        out["search", which] = sum(e.name.endswith("::search_unused_parameters")
                                   for e in prof.function_events)
    # A one-member bucket that carries the status is copied into its flat buffer: gradients
    # that require grad (backward(create_graph=True), torch's test_ddp_create_graph) too.
    for which, cls in CLASSES.items():
        torch.manual_seed(0)
        p = nn.Parameter(torch.tensor(1.0 + rank))
        net = cls(_Scalar(p))
        grads = []
        for _ in range(3):
            net().backward(create_graph=True)
            grads.append((p.grad.detach().clone(), p.grad.requires_grad))
        out["create_graph", which] = grads
    # The check the status serves still raises on every rank at the next forward, naming the
    # parameter.
    net = DistributedDataParallel(_Skips())
    net(torch.rand(3, 10), skip=rank == 0).sum().backward()
    try:
        net(torch.rand(3, 10), skip=False)
        out["unused_error"] = None
    except UnusedParametersError as e:
        out["unused_error"] = str(e)
    return out


class _Scalar(nn.Module):
    def __init__(self, p: nn.Parameter):
        super().__init__()
        self.p = p

    def forward(self):
        return self.p.pow(2)


class _Skips(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x, skip: bool):
        h = self.lin1(x)
        return h if skip else self.lin2(h)


@pytest.fixture(scope="module")
def profiled():
    return run_workers(_profiled, 2, timeout_s=120)


def test_one_all_reduce_per_iteration_for_one_bucket_as_torch(profiled):
    for out in profiled:
        assert out["linear", "ours"] == out["linear", "torch"] == (6, True)


def test_one_all_reduce_per_bucket_with_a_solo_bucket(profiled):
    for out in profiled:
        # 2 buckets, no status of its own
        assert out["mlp", "ours"] == (12, True), out["mlp", "ours"]


def test_unused_parameter_search_is_recorded_as_in_torch(profiled):
    for out in profiled:
        assert out["search", "ours"] == out["search", "torch"] == 1


def test_carrier_stages_gradients_that_require_grad(profiled):
    for out in profiled:
        ours, theirs = out["create_graph", "ours"], out["create_graph", "torch"]
        for (a, a_rg), (b, b_rg) in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b)
            assert a_rg == b_rg


def test_unused_parameters_still_raise_on_every_rank(profiled):
    r0, r1 = (out["unused_error"] for out in profiled)
    assert r0 is not None and "rank 0: 2 parameter(s) got no gradient in the previous synced" \
        " backward" in r0 and "did not receive grad for rank 0: lin2.weight, lin2.bias" in r0, r0
    assert r1 is not None and "rank 1: ranks [0] had parameters that got no gradient" in r1, r1


def test_status_carrier_is_moved_last_only_when_cheap():
    f32 = [torch.float32] * 4
    # Last bucket coalesced already: unchanged.
    assert status_carrier_last([[3, 2], [1, 0]], [8] * 4, f32, world_size=2, solo_bytes=100) == (
        [[3, 2], [1, 0]], True)
    # Last bucket a solo (>= solo_bytes): the small one before it goes last.
    assert status_carrier_last([[3, 2], [1], [0]], [8, 8, 8, 500], f32, world_size=2,
                               solo_bytes=100) == ([[3, 2], [1], [0]], True)
    assert status_carrier_last([[3, 2], [0]], [500, 8, 8, 8], f32, world_size=2,
                               solo_bytes=100) == ([[0], [3, 2]], True)
    # A one-member bucket below solo_bytes carries it (it is then copied, not reduced in place).
    assert status_carrier_last([[0]], [400], f32[:1], world_size=2,
                               solo_bytes=1 << 20) == ([[0]], True)
    # Too large to delay, or no dtype that sums the world size exactly: a separate all-reduce.
    assert status_carrier_last([[3, 2], [0]], [500, 8, 8, 8], f32, world_size=2, solo_bytes=100,
                               max_delay_bytes=10) == ([[3, 2], [0]], False)
    bf16 = [torch.bfloat16] * 4
    assert status_carrier_last([[1, 0]], [2] * 4, bf16, world_size=256, solo_bytes=None)[1]
    assert not status_carrier_last([[1, 0]], [2] * 4, bf16, world_size=257, solo_bytes=None)[1]
    assert not status_carrier_last([[1, 0]], [8] * 4, [torch.int64] * 4, world_size=2,
                                   solo_bytes=None)[1]
