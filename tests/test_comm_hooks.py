"""Comm hooks and ring all-reduce, each against the backend's all_reduce.

    .venv/bin/pytest -q tests/test_comm_hooks.py

The ring's schedule is checked in one process by simulating N ranks; the real thing runs on 2
and 3 gloo ranks over sizes that do not divide evenly (and sizes smaller than the ring).
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch
import torch.distributed as dist
from support.gpu_box import TORCH_POWERSGD_LEFT_OUT, TORCH_POWERSGD_ON_CPU
from torch import nn

from ringtrain.ddp.buckets import GradBucket
from ringtrain.ddp.comm_hooks import (
    RingAllReduceState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    ring_all_reduce,
    ring_allreduce_hook,
    ring_chunk_bounds,
    ring_schedule,
)
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.testing import run_workers

SIZES = [1, 2, 5, 17, 1001]  # odd, and smaller than the ring


# ---- pure: the plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("numel, world_size", [(10, 3), (2, 3), (0, 2), (7, 1), (1001, 4)])
def test_chunk_bounds_cover_the_buffer_in_order(numel, world_size):
    bounds = ring_chunk_bounds(numel, world_size)
    assert len(bounds) == world_size and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 3, 13])
def test_ring_schedule_simulated_gives_the_sum_on_every_rank(world_size, numel):
    g = torch.Generator().manual_seed(world_size * 100 + numel)
    data = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(world_size)]
    expected = torch.stack(data).sum(0)
    bounds = ring_chunk_bounds(numel, world_size)
    chunk = lambda r, c: data[r][bounds[c][0]:bounds[c][1]]  # noqa: E731
    plans = [ring_schedule(r, world_size) for r in range(world_size)]
    for phase in (0, 1):
        for step in range(world_size - 1):
            # All ranks send at once; rank r receives what rank r-1 sent.
            sent = [chunk(r, plans[r][phase][step][0]).clone() for r in range(world_size)]
            for r in range(world_size):
                recv = plans[r][phase][step][1]
                assert recv == plans[(r - 1) % world_size][phase][step][0]  # both ends agree
                if phase == 0:
                    chunk(r, recv).add_(sent[(r - 1) % world_size])
                else:
                    chunk(r, recv).copy_(sent[(r - 1) % world_size])
    for r in range(world_size):
        torch.testing.assert_close(data[r], expected, rtol=1e-12, atol=1e-12)


# ---- multi-process -----------------------------------------------------------------------------


def _bucket_of(t: torch.Tensor) -> GradBucket:
    return GradBucket(0, t, [t], [nn.Parameter(torch.empty_like(t))], is_last=True)


def _hooks_vs_all_reduce(rank, world_size):
    """Max abs difference of each hook's result from dist.all_reduce / world_size, per size."""
    state = RingAllReduceState()
    out: dict[str, list[float]] = {}
    for numel in SIZES:
        g = torch.Generator().manual_seed(1000 * rank + numel)
        x = torch.randn(numel, generator=g)
        expected = x.clone()
        dist.all_reduce(expected)
        summed = x.clone()
        ring_all_reduce(summed)
        out.setdefault("ring_all_reduce_sum", []).append((summed - expected).abs().max().item())
        expected /= world_size
        hooks = {
            "allreduce_hook": lambda b: allreduce_hook(None, b),
            "fp16": lambda b: fp16_compress_hook(None, b),
            "bf16": lambda b: bf16_compress_hook(None, b),
            "ring_inline": lambda b: ring_allreduce_hook(None, b),
            "ring_thread": lambda b: ring_allreduce_hook(state, b),
        }
        for name, hook in hooks.items():
            buffer = x.clone()
            result = hook(_bucket_of(buffer)).wait()
            assert result.dtype == torch.float32 and result.numel() == numel, name
            out.setdefault(name, []).append((result - expected).abs().max().item())
    # With a RingAllReduceState the hook returns at once (backward goes on) and the future
    # completes when the ring is done: rank 0 submits while rank 1 is still sleeping.
    dist.barrier()
    if rank > 0:
        time.sleep(0.3)
    buffer = torch.full((1001,), float(rank))
    fut = ring_allreduce_hook(state, _bucket_of(buffer))
    out["ring_thread_returned_early"] = [0.0 if (rank > 0 or not fut.done()) else 1.0]
    result = fut.wait()
    out["ring_thread_late"] = [(result - sum(range(world_size)) / world_size).abs().max().item()]
    # A subgroup: the ring addresses peers by their global rank.
    sub = dist.new_group(list(range(world_size)))
    y = torch.full((7,), float(rank + 1))
    ring_all_reduce(y, sub, average=True)
    out["subgroup"] = [(y - (world_size + 1) / 2).abs().max().item()]
    state.close()
    return out


def _model(hidden: int = 512) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, 3))


def _train_with_hooks(rank, world_size, names):
    """Parameters after 3 SGD steps with each hook registered (None: no hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {
        None: (None, None),
        "ring": (RingAllReduceState(), ring_allreduce_hook),
        "fp16": (None, fp16_compress_hook),
        "bf16": (None, bf16_compress_hook),
        "torch_allreduce": (None, default_hooks.allreduce_hook),
        "torch_fp16": (None, default_hooks.fp16_compress_hook),
        "torch_fp16_wrapper": (
            None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
        ),
        "torch_powersgd": (
            powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                        start_powerSGD_iter=2),
            powerSGD_hook.powerSGD_hook,
        ),
    }
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    out = {}
    for name in names:
        state, hook = hooks[name]
        # Several buckets, multi-parameter and solo. PowerSGD issues collectives from its future
        # callbacks, which races the next bucket's launch on gloo (torch's DDP hangs the same
        # way), so it gets a model that fits one bucket.
        model = _model(hidden=64 if name == "torch_powersgd" else 512)
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=None if name == "torch_powersgd" else 0.004
        )
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[name] = [p.detach().clone() for p in model.parameters()]
        if isinstance(state, RingAllReduceState):
            state.close()
    return out


def _scenarios(world_size: int) -> dict:
    hooks = [None, "ring"] if world_size == 3 else [
        None, "ring", "fp16", "bf16", "torch_allreduce", "torch_fp16", "torch_fp16_wrapper",
        *(["torch_powersgd"] if TORCH_POWERSGD_ON_CPU else [])]
    return {"vs_all_reduce": (_hooks_vs_all_reduce, ()), "train": (_train_with_hooks, (hooks,))}


def _session(rank, world_size):
    out = {}
    for name, (fn, args) in _scenarios(world_size).items():
        try:
            out[name] = ("ok", fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported by the test of this scenario
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def sessions():
    started: dict[int, list | Exception] = {}

    def results(world_size: int, name: str) -> list:
        if world_size not in started:
            try:
                started[world_size] = run_workers(_session, world_size, timeout_s=120)
            except Exception as e:  # noqa: BLE001 - report once per test, do not restart
                started[world_size] = e
        if isinstance(started[world_size], Exception):
            pytest.fail(f"the {world_size}-rank session failed: {started[world_size]}")
        values = []
        for rank, out in enumerate(started[world_size]):
            status, value = out[name]
            if status == "error":
                pytest.fail(f"rank {rank}, scenario {name!r}:\n{value}")
            values.append(value)
        return values

    return results


# fp16 keeps ~3 significant digits, bf16 ~2; inputs are O(1) and averaged over <= 3 ranks.
TOLERANCE = {"ring_thread_returned_early": 0, "ring_thread_late": 1e-6, "ring_all_reduce_sum": 1e-5,
             "allreduce_hook": 1e-6, "ring_inline": 1e-6, "ring_thread": 1e-6,
             "fp16": 2e-3, "bf16": 2e-2, "subgroup": 1e-6}


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_and_ring_match_backend_all_reduce(sessions, world_size):
    for rank, out in enumerate(sessions(world_size, "vs_all_reduce")):
        for name, errors in out.items():
            assert max(errors) <= TOLERANCE[name], (
                f"rank {rank} {name}: errors per size {SIZES}: {errors}"
            )
        # Compression must actually compress: fp16 is not bit-exact on random data.
        assert max(out["fp16"]) > 0 and max(out["bf16"]) > max(out["fp16"])


@pytest.mark.skipif(not TORCH_POWERSGD_ON_CPU, reason=TORCH_POWERSGD_LEFT_OUT)
def test_torch_powersgd_hook_trained_in_the_session(sessions):
    assert all("torch_powersgd" in out for out in sessions(2, "train"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_with_hooks_matches_no_hook(sessions, world_size):
    results = sessions(world_size, "train")
    tol = {"ring": 1e-6, "torch_allreduce": 1e-6, "fp16": 1e-3, "torch_fp16": 1e-3,
           "torch_fp16_wrapper": 1e-3, "bf16": 1e-2}
    for rank, out in enumerate(results):
        for name, params in out.items():
            if name is None:
                continue
            for k, (p, q) in enumerate(zip(params, results[0][name], strict=True)):
                assert torch.equal(p, q), f"{name}: replica {rank} differs from rank 0 at param {k}"
            if name in tol:
                diff = max((p - q).abs().max().item()
                           for p, q in zip(params, out[None], strict=True))
                assert diff <= tol[name], (
                    f"rank {rank} {name}: max |param - no-hook param| = {diff:.2e}"
                )
