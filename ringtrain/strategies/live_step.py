"""A strategy's step in live recovery (`ringtrain train --live`): `base.LiveHooks`, for replicas.

    hooks = strategy.live_hooks()          # None: this strategy has no live recovery
    hooks.on_members(runtime)              # a new generation: this rank of that many, its group
    result = hooks.train_step(micro, lr=lr, grad_clip=1.0, weight=len(ids) / global_batch)

The trainer's loop (`ringtrain.training.live`) owns the generations, the batches and the
commits; the strategy owns the step over whichever members there are. `ReplicaLiveHooks` is the
step of a strategy whose ranks hold whole replicas (ddp): forward and backward of this member's
share (`accumulate`, the one step loop), then the gradients *summed* over the generation's group,
each member's weighted by its share of the global batch (`weight`): the sum is the global batch's
mean gradient whatever the number of members, where DDP's average would weigh a member with a
larger share (a survivor that took a lost member's samples) like the others.

Not DDP's wrapper, on purpose: a generation's group is built directly on the store
(`ringtrain.live.group`), outside torch's registry, which our `DistributedDataParallel` checks
its group against; a wrapper per generation would also broadcast the weights again and rebuild
its buckets (their order learnt in the first step), each time a member leaves or joins. One flat
all-reduce per step is what the wrapper's buckets amount to on a CPU-sized model; a large model
would want the buckets back (overlap with backward), which is left for later.

`ringtrain.strategies.localsgd_live.RoundLiveHooks` is local SGD's and DiLoCo's, whose replicas
meet every H steps: there the meetings are the commit points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringtrain.strategies.base import LiveHooks, StepResult
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["ReplicaLiveHooks", "one_replica_view"]


class ReplicaLiveHooks(LiveHooks):
    """The live step of a strategy holding a whole replica per rank (`strategy.module`,
    `optimizer`, `loss_fn`, `runtime`, `tracer`, as `DDPStrategy` has them after setup)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.model, self.optimizer = strategy.module, strategy.optimizer

    def on_members(self, runtime: Runtime) -> None:
        # The strategy's rank and world size are its data shard and eval shard: the members'.
        self.strategy.runtime = runtime

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float) -> StepResult:
        s = self.strategy
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        if micro_batches:
            acc = accumulate(micro_batches, self.model, s.loss_fn, device=s.runtime.device,
                             tracer=s.tracer)
            loss_sum, count = acc.loss_sum, acc.count
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(weight)
        else:  # more members than samples in the step: a zero contribution, same collectives
            loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        t0 = time.perf_counter()
        with s.tracer.span("all-reduce"):
            _sum_gradients(self.model, s.runtime.process_group)
        comm_s = time.perf_counter() - t0
        # Every member holds the same summed gradients: the same clip factor everywhere.
        optimizer_step(self.optimizer, s.tracer, grad_clip=grad_clip,
                       clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(
                           self.model.parameters(), max_norm))
        return StepResult(loss_sum=loss_sum, count=count,
                          compute_s=time.perf_counter() - start - comm_s, comm_s=comm_s)


def _sum_gradients(model: nn.Module, group: Any) -> None:
    """Sum every parameter's gradient over `group` in one flat all-reduce (None: zeros).

    `ringtrain.live.all_reduce_gradients` for `ringtrain run` scripts does the same; not imported
    from there because `ringtrain.live` reads `ringtrain.checkpoint`, which reads the strategies.
    The group's own method: a generation's group is outside torch's registry.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    group.allreduce([flat]).wait()
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def one_replica_view(runtime: Runtime) -> Runtime:
    """The runtime a live strategy is built with: one rank, no group (the live group's
    generations set the rank and group later, through `LiveHooks.on_members`)."""
    return replace(runtime, rank=0, world_size=1)
