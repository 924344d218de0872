"""Reduce-scatter and all-gather on gloo, built from send/recv rings, next to naive references.

Who uses them: ZeRO (`ringtrain.zero.units`: every unit's gradients and parameters) and
tensor parallelism's sequence-parallel reduce-scatter on gloo (`ringtrain.tensor_parallel.comm`).

Why not gloo's own: measured on this 2-core host (2 ranks, 4 MiB fp32, medians of 7; 3 ranks in
brackets): `reduce_scatter_tensor` 6.4 ms (8.0), one `all_reduce` of the whole buffer 9.2 ms
(9.7), the ring below 3.5 ms (6.5); at 16 MiB 24.6 / 21.1 / 15.8 ms (36.5 / 28.8 / 28.5); on a
quiet host (session 29, 2 ranks, 4 MiB) 3.8 ms / 2.7 ms / 0.97 ms. Gloo implements
reduce-scatter as one reduction per rank; the ring (Patarasuk & Yuan 2009, the first half of a
ring all-reduce) sends each rank's (N-1)/N of the buffer once. gloo's `all_gather_into_tensor` is
as fast as the ring (3.3 ms at 4 MiB) but aborts the whole process on a shape mismatch (a C++
CHECK, no exception) and needs an input apart from its output; the ring gathers in place, which
ZeRO-1/2 want (the shard is a view of the full flat parameters).

A ring in flight is a `RingWork`: its first exchange is launched at once (with 2 ranks that is
all of it, so a launch from a backward hook overlaps the rest of backward), `wait()` runs the
remaining N-2 exchanges. Every rank must launch the same rings in the same order per group.
Tests: `.venv/bin/pytest -q tests/test_rings.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain import collectives as checked  # agreed first under RINGTRAIN_DEBUG=collectives
from ringtrain import staging


def _check(flat: torch.Tensor, world_size: int, what: str) -> int:
    if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % world_size:
        raise ValueError(f"{what}: the flat buffer must be 1-D, contiguous and a multiple of "
                         f"world_size={world_size} elements; got shape {tuple(flat.shape)}: pad "
                         "it to a multiple (ringtrain.zero.shard.plan_units does)")
    return flat.numel() // world_size


class RingWork:
    """A ring collective in flight over `group`; `wait()` finishes it (call once, every rank)."""

    def __init__(self, group: dist.ProcessGroup, steps: int):
        self.group, self.steps = group, steps
        self.rank, self.world_size = group.rank(), group.size()
        self._works: list = []
        self._step = 0

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        n = self.world_size
        # CUDA tensors on gloo cross a host copy (ringtrain.staging); the rest is torch's call.
        self._works = [staging.isend(send, self.group, group_dst=(self.rank + 1) % n),
                       staging.irecv(recv, self.group, group_src=(self.rank - 1) % n)]

    def _finish_exchange(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []

    def _advance(self, step: int) -> None:  # after exchange `step` arrived: combine, send next
        raise NotImplementedError

    def wait(self) -> None:
        while self._step < self.steps:
            self._finish_exchange()
            self._advance(self._step)
            self._step += 1


class _ReduceScatter(RingWork):
    # Step s: rank r sends its running sum of chunk (r - s - 1) % N to r + 1 and receives the
    # running sum of chunk (r - s - 2) % N from r - 1, adding its own. After N - 1 steps it holds
    # chunk r summed over every rank (the sum starts at rank r + 1 and ends here).
    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
        super().__init__(group, group.size() - 1)
        self.output, self.chunks = output, input.view(self.world_size, -1)
        # Two buffers alternate (one is sent while the next arrives). The last exchange can
        # land in `output` itself unless `output` is part of `input` (ZeRO-1): with 2 ranks
        # (one exchange) that saves allocating and reading a buffer per reduce.
        lo, hi = input.data_ptr(), input.data_ptr() + input.numel() * input.element_size()
        apart = not lo <= output.data_ptr() < hi
        last = (self.steps - 1) % 2
        self._bufs = [output if apart and i == last else torch.empty_like(output)
                      for i in range(min(2, self.steps))]
        self._exchange(self.chunks[(self.rank - 1) % self.world_size], self._bufs[0])

    def _advance(self, step: int) -> None:
        got, own = self._bufs[step % 2], self.chunks[(self.rank - step - 2) % self.world_size]
        if step == self.steps - 1:
            torch.add(got, own, out=self.output)  # `got`, or `own` (ZeRO-1), may be `output`
            self._bufs = []
            return
        got.add_(own)
        self._exchange(got, self._bufs[(step + 1) % 2])


class _AllGather(RingWork):
    # Step s: rank r sends chunk (r - s) % N (its own first) and receives chunk (r - s - 1) % N
    # straight into its place in the flat buffer.
    def __init__(self, flat: torch.Tensor, group: dist.ProcessGroup):
        super().__init__(group, group.size() - 1)
        self.chunks = flat.view(self.world_size, -1)
        self._exchange(self.chunks[self.rank], self.chunks[(self.rank - 1) % self.world_size])

    def _advance(self, step: int) -> None:
        if step < self.steps - 1:
            r, n = self.rank, self.world_size
            self._exchange(self.chunks[(r - step - 1) % n], self.chunks[(r - step - 2) % n])


class _Done:
    def wait(self) -> None:
        return None


def reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                   group: dist.ProcessGroup) -> RingWork | _Done:
    """Start summing `input` (N equal chunks) over `group`; rank r gets chunk r in `output`.

    Args:
        output: 1-D, `input.numel() // N` elements; may be chunk r of `input` itself.
        input: 1-D flat buffer, a multiple of N elements; read until `wait()` returns.
        group: the ranks to sum over (every one calls this, same order of calls).
    """
    n = group.size()
    shard = _check(input, n, "reduce_scatter")
    checked.check("reduce_scatter", [input], group)
    if output.numel() != shard:
        raise ValueError(f"reduce_scatter: output has {output.numel()} elements, it needs "
                         f"input.numel() // world_size = {shard}")
    if n == 1:
        output.copy_(input)
        return _Done()
    return _ReduceScatter(output, input, group)


def all_gather(flat: torch.Tensor, group: dist.ProcessGroup) -> RingWork | _Done:
    """Start filling `flat` (N equal chunks, chunk r already this rank's) with every rank's
    chunk."""
    n = group.size()
    _check(flat, n, "all_gather")
    checked.check("all_gather", [flat], group)
    return _Done() if n == 1 else _AllGather(flat, group)


# ---- the naive references (what the rings must equal; readers start here) ---------------------

def reduce_scatter_naive(output: torch.Tensor, input: torch.Tensor,
                         group: dist.ProcessGroup) -> None:
    """Sum the whole buffer on every rank, keep chunk r: twice the bytes of the ring."""
    n, r = group.size(), group.rank()
    shard = _check(input, n, "reduce_scatter_naive")
    total = input.clone()
    dist.all_reduce(total, group=group)
    output.copy_(total[r * shard:(r + 1) * shard])


def all_gather_naive(flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """gloo's all_gather into per-rank views, own chunk sent from a copy."""
    n, r = group.size(), group.rank()
    chunks = list(_check(flat, n, "all_gather_naive") and flat.view(n, -1).unbind(0))
    dist.all_gather(chunks, chunks[r].clone(), group=group)
