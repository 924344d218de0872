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

A fault in the all-reduce: each member keeps what it computed (`Contribution`: the gradients the
flat buffer was cut from, so no copy) and the redo of the step trains only the samples nobody
holds, the lost members' shares, split over the members (`GlobalBatches.redo_shares`): a stall
costs a third of a share's compute for 4 -> 3 members, not the whole step again over 3. A spare
in the lost member's place trains exactly its share, and the all-reduce over the same ranks then
gives the fault-free sums bit for bit. Kept until the next step starts: one gradient's worth of
memory more between steps.

`ringtrain.strategies.localsgd_live.RoundLiveHooks` is local SGD's and DiLoCo's, whose replicas
meet every H steps: there the meetings are the commit points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringtrain.flat_sum import add_held, flat_all_reduce
from ringtrain.strategies.base import LiveHooks, StepResult
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["Contribution", "LiveStepError", "ReplicaLiveHooks", "one_replica_view"]


class LiveStepError(Exception):
    """A live step failed after it began to change the state a commit holds in place: not a
    RuntimeError, so the live loop does not take it for a lost peer and redo the step."""


@dataclass
class Contribution:
    """A member's summands of one step as they were before its all-reduce: per parameter the
    gradient of its samples weighted by their share of the global batch (None: none), their
    loss sum and their number. Gloo reduces in place, so these are the tensors the flat
    buffer was cut from, not it: keeping them costs no copy."""

    grads: list[torch.Tensor | None]
    loss_sum: torch.Tensor
    count: int


class ReplicaLiveHooks(LiveHooks):
    """The live step of a strategy holding a whole replica per rank (`strategy.module`,
    `optimizer`, `loss_fn`, `runtime`, `tracer`, as `DDPStrategy` has them after setup)."""

    # The all-reduce is the step's last collective, the optimizer's step comes after it: a
    # commit keeps the live tensors (no 40 MB copy a step for a 3.3 M-parameter GPT with
    # AdamW), and an error in the optimizer's step is a `LiveStepError`, never recovered.
    commits_in_place = True

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.model, self.optimizer = strategy.module, strategy.optimizer
        self._made: Contribution | None = None  # the last step's, until the next one starts

    def on_members(self, runtime: Runtime) -> None:
        # The strategy's rank and world size are its data shard and eval shard: the members'.
        self.strategy.runtime = runtime

    def contribution(self) -> Contribution | None:
        return self._made

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float,
                   held: Contribution | None = None) -> StepResult:
        s = self.strategy
        start = time.perf_counter()
        self._made = None  # dropped before the backward: at most one step's gradients kept
        lr_into(self.optimizer, lr)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if micro_batches:
            acc = accumulate(micro_batches, self.model, s.loss_fn, device=s.runtime.device,
                             tracer=s.tracer)
            loss_sum, count = acc.loss_sum, acc.count
            grads = [p.grad.mul_(weight) if p.grad is not None else None for p in params]
        else:  # more members than samples in the step: a zero contribution, same collectives
            loss_sum, count = torch.zeros((), dtype=torch.float64), 0
            grads = [None] * len(params)
        if held is not None:  # the same step from before a fault: its summands, added once
            grads = add_held(grads, held.grads)
            # Nothing new: exactly what was held (a spare trains the rest: bit for bit).
            loss_sum = loss_sum + held.loss_sum if micro_batches else held.loss_sum
            count += held.count
        self._made = Contribution(grads, loss_sum, count)
        t0 = time.perf_counter()
        with s.tracer.span("all-reduce"):
            _sum_gradients(params, grads, s.runtime.process_group)
        comm_s = time.perf_counter() - t0
        # Every member holds the same summed gradients: the same clip factor everywhere.
        try:
            optimizer_step(self.optimizer, s.tracer, grad_clip=grad_clip,
                           clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(
                               self.model.parameters(), max_norm))
        except RuntimeError as error:  # not a lost peer: the loop must not recover it
            raise LiveStepError(
                f"the optimizer's step failed after the gradients' all-reduce ({error}): the "
                "model and optimizer may be half a step on, and the commit holds them in place "
                "(commits_in_place), so the step cannot be redone; the job goes on without "
                "this member") from error
        return StepResult(loss_sum=loss_sum, count=count,
                          compute_s=time.perf_counter() - start - comm_s, comm_s=comm_s)


def _sum_gradients(params: list[nn.Parameter], grads: list[torch.Tensor | None],
                   group: Any) -> None:
    """Sum `grads` (None: zeros) over `group` in one flat all-reduce; each parameter's
    gradient becomes its view of the sum, and `grads` stay as they were (the step's
    `Contribution`, should the all-reduce fail)."""
    for p, g in zip(params, flat_all_reduce(group, grads, params), strict=True):
        p.grad = g


def one_replica_view(runtime: Runtime) -> Runtime:
    """The runtime a live strategy is built with: one rank, no group (the live group's
    generations set the rank and group later, through `LiveHooks.on_members`)."""
    return replace(runtime, rank=0, world_size=1)
