"""Point-to-point through host memory (ringtrain.staging), the path CUDA tensors take over gloo.

On a CPU box the host path is forced on CPU tensors: the same copies and the same ordering
(a send reads its tensor when posted; a receive's tensor is filled by `wait()`), so ZeRO's rings
through it must equal the direct rings bit for bit. tests/test_cuda.py runs it on a GPU.

    .venv/bin/pytest -q tests/test_staging.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain import staging
from ringtrain.testing import run_workers


def _send_recv(rank, world_size):
    group = dist.group.WORLD
    if rank == 0:
        t = torch.arange(6, dtype=torch.float32)
        work = staging.isend(t, group, dst=1, stage=True)
        t.zero_()  # the host copy was taken when posted: the receiver gets 0..5
        work.wait()
        staging.send(torch.tensor([7.0, 8.0]), group, group_dst=1)
        return None
    out = torch.full((6,), -1.0)
    work = staging.irecv(out, group, src=0, stage=True)
    work.wait()
    small = torch.empty(2)
    staging.recv(small, group, group_src=0)
    return out.tolist(), small.tolist(), staging.needs_host(small, group)


def test_a_staged_send_and_receive_carry_the_values_posted():
    _, (out, small, needs) = run_workers(_send_recv, 2, timeout_s=60)
    assert out == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert small == [7.0, 8.0]
    assert needs is False  # a CPU tensor on gloo goes as it is


def _rings(flat, world_size, group):
    from ringtrain import rings

    reduced, gathered = torch.empty(flat.numel() // world_size), flat.clone()
    rings.reduce_scatter(reduced, flat, group).wait()
    rings.all_gather(gathered, group).wait()
    return reduced, gathered


def _rings_through_host(rank, world_size):
    group = dist.group.WORLD
    flat = torch.randn(world_size * 5, generator=torch.Generator().manual_seed(rank))
    direct = _rings(flat, world_size, group)
    staging.needs_host = lambda tensor, group: True  # every exchange through a host copy
    staged = _rings(flat, world_size, group)
    return [torch.equal(a, b) for a, b in zip(direct, staged, strict=True)]


def test_zero_rings_through_host_memory_equal_the_direct_rings():
    assert run_workers(_rings_through_host, 3, timeout_s=90) == [[True, True]] * 3
