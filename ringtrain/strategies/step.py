"""One step loop: gradient accumulation, clipping, the optimizer step and zero_grad, written once.

    lr_into(optimizer, lr)
    acc = accumulate(micro_batches, ddp, loss_fn, device=device, tracer=tracer, no_sync=ddp.no_sync)
    optimizer_step(optimizer, tracer, grad_clip=grad_clip, clip=clip_fn)
    return StepResult(loss_sum=acc.loss_sum, count=acc.count, ...)

Every strategy that runs forward and backward itself on whole replicas (ddp, zero, localsgd,
diloco, a parameter-server worker) calls these; the pipeline runs its own schedule. Four copies
of this loop had drifted apart (one copied batches without `non_blocking`, one synchronised
with the device after every micro-batch).

Two things the loop does not do, on purpose:
- no host synchronisation: the loss sum stays a device tensor (`Accumulated.loss_sum`); the
  trainer reads it once per metrics line (`ringtrain.training.state.LoopState`), so on a GPU
  the host queues step n+1 (and prepares its batch) while step n still runs;
- no copy that waits: inputs move with `non_blocking=True`; the trainer hands over page-locked
  (pinned) batches on CUDA, so the copy is asynchronous too (on a CPU it is no copy at all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ringtrain.trace import Tracer
from ringtrain.types import LossFn

__all__ = ["Accumulated", "accumulate", "loss_sum_dtype", "lr_into", "optimizer_step"]


@dataclass
class Accumulated:
    """What the micro-batches of one step gave: the loss sum (a device tensor) and samples."""

    loss_sum: torch.Tensor  # sum over micro-batches of (mean loss x samples), on the device
    count: int  # samples in the step


def loss_sum_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it: the sums are then the ones Python floats gave (each
    micro-batch's fp32 loss widened, times its samples, added in order), bit for bit. MPS has no
    float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def lr_into(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """This step's learning rate into every parameter group (the trainer's schedule)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def accumulate(micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
               model: Callable[[torch.Tensor], torch.Tensor], loss_fn: LossFn, *,
               device: torch.device, tracer: Tracer,
               no_sync: Callable[[], AbstractContextManager] | None = None,
               before_last_backward: Callable[[], None] | None = None) -> Accumulated:
    """Forward and backward every micro-batch, accumulating the gradient of the step's mean loss.

    Args:
        micro_batches: (inputs, targets) pairs, on the host or the device already.
        model: what runs forward (the wrapper: DDP's hooks must see it).
        loss_fn: (logits, targets) -> mean loss.
        device: where the model is.
        tracer: records a "forward" and a "backward" span per micro-batch.
        no_sync: the wrapper's `no_sync`; every micro-batch but the last runs under it, so
            gradients are communicated once per step. None: nothing to suspend.
        before_last_backward: called after the last forward, just before its backward (a
            parameter-server worker opens its push there: buckets leave during that backward).
    """
    total = sum(len(x) for x, _ in micro_batches)
    dtype = loss_sum_dtype(device)
    loss_sum: torch.Tensor | None = None
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with nullcontext() if last or no_sync is None else no_sync():
            with tracer.span("forward", micro_batch=i):
                loss = loss_fn(model(x), y)
            if last and before_last_backward is not None:
                before_last_backward()
            # Each micro-batch weighted by its share of the samples: the accumulated gradient
            # is then the mean over the whole step batch, whatever the split.
            with tracer.span("backward", micro_batch=i):
                (loss * (len(x) / total)).backward()
        part = loss.detach().to(dtype) * len(x)  # no float(): that would wait for the device
        loss_sum = part if loss_sum is None else loss_sum + part
    assert loss_sum is not None, "accumulate() needs at least one micro-batch"
    return Accumulated(loss_sum, total)


def optimizer_step(optimizer: torch.optim.Optimizer, tracer: Tracer, *, grad_clip: float | None,
                   clip: Callable[[float], object]) -> None:
    """Clip the gradients by their global norm (`clip(max_norm)`, the strategy's own: a sharded
    strategy sums its shards' squares), step, and drop the gradients (set to None, so the next
    backward writes rather than adds)."""
    if grad_clip:
        clip(grad_clip)
    with tracer.span("optimizer step"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
