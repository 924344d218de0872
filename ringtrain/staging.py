"""Point-to-point sends and receives that also work for CUDA tensors over gloo.

    work = staging.isend(tensor, group, group_dst=1)    # as dist.isend
    work = staging.irecv(buffer, group, group_src=0)    # as dist.irecv; buffer filled by wait()
    work.wait()

gloo's collectives take CUDA tensors (all_reduce, broadcast, all_gather copy through the host
themselves), but its send and recv hand the tensor's pointer to a TCP socket: a CUDA pointer
there fails in `writev` and the peer sees "Connection closed by peer" (measured on an H200 with
torch 2.11: ZeRO's rings over gloo with CUDA tensors). Every point-to-point call of ringtrain's
(ZeRO's rings, the pipeline's activations, the parameter server's messages, the ring hooks of
DDP) goes through here: for a CPU tensor, or any tensor on NCCL, it is torch's own call; for a
CUDA tensor on gloo the data crosses a host copy:
- a send copies the tensor to host memory first (so the caller may reuse the tensor at once,
  as with any send whose `wait()` has not returned: do not change it before), and sends that;
- a receive lands in a host buffer, and `wait()` copies it into the caller's tensor.
That path is for testing multi-process code on a box with fewer GPUs than ranks (`--backend gloo
--device cuda`, `ringtrain.launch.device`); NCCL is the production path. Tests: `pytest -q
tests/test_staging.py` (the host path is forced on CPU tensors there, and run on CUDA where one is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["StagedWork", "irecv", "isend", "needs_host", "recv", "send"]


def needs_host(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """True where `tensor` cannot go to gloo's send/recv as it is: not on the CPU, gloo group."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


class StagedWork:
    """A posted send or receive; `wait()` finishes it (and fills a staged receive's tensor).

    Args:
        work: torch's `Work` of the call on the host copy (or on the tensor itself).
        host: the host copy sent or received into; kept alive until `wait()`.
        into: for a staged receive, the caller's tensor `host` is copied into by `wait()`.
    """

    def __init__(self, work: dist.Work, host: torch.Tensor | None = None,
                 into: torch.Tensor | None = None):
        self.work, self.host, self.into = work, host, into

    def wait(self) -> bool:
        done = self.work.wait()
        if self.into is not None:
            self.into.copy_(self.host)  # on the device's current stream: later kernels see it
            self.into = None
        self.host = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    # Synchronous on purpose: the send must read the values the tensor holds now.
    return tensor.detach().to("cpu", copy=True)


def isend(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, dst: int | None = None,
          group_dst: int | None = None, tag: int = 0, stage: bool | None = None) -> StagedWork:
    """`dist.isend(tensor, ...)`, through a host copy where gloo cannot read `tensor`.

    Args:
        dst, group_dst: the receiver as a global rank, or as a rank of `group` (one of them).
        stage: force the host copy on (tests) or off; None decides by `needs_host`.
    """
    staged = needs_host(tensor, group) if stage is None else stage
    data = _host_copy(tensor) if staged else tensor
    work = dist.isend(data, dst, group=group, tag=tag, **_peer("group_dst", group_dst))
    assert work is not None, "this rank is not in the group"
    return StagedWork(work, host=data if staged else None)


def irecv(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, src: int | None = None,
          group_src: int | None = None, tag: int = 0, stage: bool | None = None) -> StagedWork:
    """`dist.irecv(tensor, ...)`; where staged, `tensor` holds the data once `wait()` returns."""
    staged = needs_host(tensor, group) if stage is None else stage
    host = torch.empty(tensor.shape, dtype=tensor.dtype) if staged else tensor
    work = dist.irecv(host, src, group=group, tag=tag, **_peer("group_src", group_src))
    assert work is not None, "this rank is not in the group"
    return StagedWork(work, host=host, into=tensor) if staged else StagedWork(work)


def send(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, **peer) -> None:
    """`dist.send`, through a host copy where needed (`isend` then `wait`)."""
    isend(tensor, group, **peer).wait()


def recv(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, **peer) -> None:
    """`dist.recv` into `tensor`, through a host buffer where needed."""
    irecv(tensor, group, **peer).wait()


def _peer(name: str, value: int | None) -> dict[str, int]:
    # group_dst/group_src only where given: torch rejects both a global and a group rank.
    return {} if value is None else {name: value}
