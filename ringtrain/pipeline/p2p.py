"""How pipeline stages talk: point-to-point send/recv of activations, gradients and shapes.

The schedule decides *what* crosses a stage boundary and when; this file only says *how*:
`torch.distributed` isend/recv on the pipeline's process group, to and from global ranks.
Sends and receives are both posted without waiting and return a handle to `wait()` on: the
engine posts each receive one step ahead, so the transfer overlaps compute. gloo supports both
on CPU, NCCL on CUDA (tensors must then live on the GPU).

Shapes are not the user's business: `send_meta`/`recv_meta` carry a boundary tensor's shape
and dtype once, in the dry run (`engine.py`), as a small int64 header.

    .venv/bin/pytest -q tests/test_pipeline.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain import staging

# dtypes a boundary tensor may have; the header carries the index.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
           torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype index, shape padded with zeros


def send_meta(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Tell global rank `dst` the shape and dtype of the tensor that will follow."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"a stage output has {tensor.dim()} dims; at most {_MAX_DIMS} can "
                         "cross a stage boundary")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"a stage output has dtype {tensor.dtype}, which cannot cross a stage "
                        f"boundary; use one of {_DTYPES}")
    header = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
    header += [0] * (_HEADER - len(header))
    staging.send(torch.tensor(header, dtype=torch.int64, device=tensor.device), group, dst=dst)


def recv_meta(src: int, group: dist.ProcessGroup,
              device: torch.device) -> tuple[torch.Size, torch.dtype]:
    """Receive the shape and dtype that global rank `src` announced with `send_meta`."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    staging.recv(header, group, src=src)
    ndim, index, *shape = header.tolist()
    return torch.Size(shape[:ndim]), _DTYPES[index]


@dataclass
class PendingSend:
    """A posted send; holds its buffer, which must stay alive and unchanged until `wait()`."""

    work: staging.StagedWork
    buffer: torch.Tensor

    def wait(self) -> None:
        self.work.wait()


# Activations and gradients travel under different tags: between two ranks of an interleaved
# pipeline both kinds flow the same way (pp=2: rank 0 sends chunk 0's activations and chunk 1's
# gradients to rank 1), and each kind's order is fixed by a different phase of the schedule.
ACTIVATION_TAG, GRAD_TAG = 0, 1


def _isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int) -> PendingSend:
    buffer = tensor.detach().contiguous()
    work = staging.isend(buffer, group, dst=dst, tag=tag)
    return PendingSend(work, buffer)


@dataclass
class PendingRecv:
    """A posted receive. Posting ahead of need lets the transfer run while this rank computes:
    gloo moves data only once both sides have posted, on its own I/O threads."""

    work: staging.StagedWork
    buffer: torch.Tensor
    needs_grad: bool = False  # an activation: hand it out as a leaf that requires grad

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer.requires_grad_(self.needs_grad and self.buffer.is_floating_point())


def _irecv(shape: torch.Size, dtype: torch.dtype, device: torch.device, src: int,
           group: dist.ProcessGroup, needs_grad: bool, tag: int) -> PendingRecv:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    work = staging.irecv(buffer, group, src=src, tag=tag)
    return PendingRecv(work, buffer, needs_grad)


def send_activation(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> PendingSend:
    """Post a stage's output to the next stage (global rank `dst`); wait on the work later."""
    return _isend(tensor, dst, group, ACTIVATION_TAG)


def recv_activation(shape: torch.Size, dtype: torch.dtype, device: torch.device, src: int,
                    group: dist.ProcessGroup) -> PendingRecv:
    """Post a receive for the previous stage's output; `wait()` gives a leaf that needs grad."""
    return _irecv(shape, dtype, device, src, group, needs_grad=True, tag=ACTIVATION_TAG)


def send_grad(grad: torch.Tensor, dst: int, group: dist.ProcessGroup) -> PendingSend:
    """Post d(loss)/d(input) back to the previous stage (global rank `dst`)."""
    return _isend(grad, dst, group, GRAD_TAG)


def recv_grad(shape: torch.Size, dtype: torch.dtype, device: torch.device, src: int,
              group: dist.ProcessGroup) -> PendingRecv:
    """Post a receive for the next stage's d(loss)/d(our output); `wait()` gives it."""
    return _irecv(shape, dtype, device, src, group, needs_grad=False, tag=GRAD_TAG)
