"""Ring all-reduce moves 2(N-1)/N of the buffer per rank, whatever N is: counted, byte by byte.

    .venv/bin/python examples/concepts/ring_bytes.py            # N = 2, 3, 4 ranks, ~15 s

For each N, N gloo ranks sum a 1 MB fp32 buffer twice, counting every byte each rank hands to
`isend`: once with the ring (`ringtrain.ddp.comm_hooks.ring_all_reduce`: a reduce-scatter then an
all-gather, N-1 steps each, one chunk of 1/N of the buffer per step), once with the naive scheme
(everyone sends its buffer to rank 0, rank 0 adds them up and sends the sum back). Both give
torch's `all_reduce` result. The ring's bytes per rank stay under 2 x the buffer for any N;
the naive scheme's rank 0 sends (N-1) x the buffer, and grows with N: the bottleneck the ring
removes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain.ddp.comm_hooks import ring_all_reduce
from ringtrain.testing import run_workers

NUMEL = 250_000  # 1 MB of fp32


def _counting(sent: list[int]):
    """Wrap dist.isend so that every byte this rank sends is counted."""
    isend = dist.isend

    def counted(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)
    return isend, counted


def naive_all_reduce(buf: torch.Tensor) -> None:
    """Sum at rank 0, then send the sum back: (N-1) buffers in and out of rank 0."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(buf)
        for src in range(1, n):
            dist.irecv(incoming, src=src).wait()
            buf.add_(incoming)
        for dst in range(1, n):
            dist.isend(buf, dst=dst).wait()
    else:
        dist.isend(buf, dst=0).wait()
        dist.irecv(buf, src=0).wait()


def _worker(rank: int, world_size: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(NUMEL, generator=g)
    expected = data.clone()
    dist.all_reduce(expected)
    out = {}
    for name, fn in (("ring", ring_all_reduce), ("naive", naive_all_reduce)):
        sent = [0]
        original, dist.isend = _counting(sent)
        try:
            buf = data.clone()
            fn(buf)
        finally:
            dist.isend = original
        assert torch.allclose(buf, expected, atol=1e-5), (
            f"{name} all-reduce is wrong on rank {rank}"
        )
        out[name] = sent[0]
    return out


def main() -> None:
    size = NUMEL * 4
    print(f"buffer: {size:,} bytes; bytes sent per rank, as a multiple of the buffer")
    print(f"{'N':>3}{'ring, each rank':>17}{'theory 2(N-1)/N':>17}{'naive, rank 0':>15}"
          f"{'naive, others':>15}")
    for n in (2, 3, 4):
        sent = run_workers(_worker, n, timeout_s=120)
        ring = [s["ring"] / size for s in sent]
        assert max(ring) - min(ring) < 1e-3  # every rank sends the same amount
        print(f"{n:>3}{ring[0]:>17.4f}{2 * (n - 1) / n:>17.4f}{sent[0]['naive'] / size:>15.4f}"
              f"{sent[1]['naive'] / size:>15.4f}")


if __name__ == "__main__":
    main()
