"""The live step loop: take the step's share, step, commit; on a failed collective, recover.

    def step(ids, process_group):            # this member's sample ids of the step
        loss = model(x[ids]).sub(y[ids]).pow(2).sum() / batches.global_batch_size
        loss.backward()
        all_reduce_gradients(model, process_group)   # sums: the global batch's mean gradient
        optimizer.step(); optimizer.zero_grad()
        return loss.detach()

    train_live(LiveGroup(store, 3), LiveState(model, optimizer, batches), step, num_steps=100)

The loss is divided by the *global* batch size and the gradients are summed, not averaged: a
member's share of the batch changes with the number of members, the sum over the batch does
not, so every step's gradient is the fault-free one whoever computed its pieces (up to the
order of the additions). The step function may raise any RuntimeError from a collective (a
dead peer: gloo's "Connection reset by peer" at once; a hung one: its timeout); the loop then
restores the last commit, forms the next generation, and redoes the same step (`state.step`
did not move) over the same global batch. With `gradients=LiveGradients(model)` (its
`all_reduce` in place of `all_reduce_gradients`) the redo trains only the samples nobody holds
from before the fault (`ringtrain.live.redo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.live.group import LiveGroup, LiveMemberLostError, LiveRecoveryError
from ringtrain.live.redo import LiveGradients, agree_shares
from ringtrain.live.state import LiveState

StepFn = Callable[[list[int], dist.ProcessGroup], Any]


def all_reduce_gradients(model: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Sum every parameter's gradient over the group, in one flat all-reduce.

    A parameter without a gradient (a member with an empty share) contributes zeros.
    `LiveGradients.all_reduce` with nothing held; None: the default group.
    """
    LiveGradients(model).all_reduce(process_group if process_group is not None
                                    else dist.group.WORLD)


def train_live(group: LiveGroup, state: LiveState, step: StepFn, num_steps: int, *,
               on_commit: Callable[[int, Any], None] | None = None,
               gradients: LiveGradients | None = None) -> bool:
    """Train until `state.step == num_steps`, surviving lost members; False if never let in.

    Args:
        group: this process's `LiveGroup` (not yet joined).
        state: its `LiveState`; `state.batches` gives each step's share.
        step: `step(ids, process_group)` runs one step on this member's share of the global
            batch and returns what `on_commit` gets.
        num_steps: the step count to reach.
        on_commit: called with (step, result) after each committed step, on each member.
            The commit is the member's own: a member that commits a step and dies at once
            may have cut a slower peer's all-reduce of that same step (a marked departure
            fails it at once), and the survivors then redo the step without it. Side effects
            that must happen once for the group (a log line, a file) belong to a member that
            survives, or to an agreement among them, as `ringtrain train` agrees its metrics.
        gradients: the `LiveGradients` that `step` sums its gradients with (the same on every
            member, or None on every member): a step redone after a fault then trains only
            the samples nobody holds (`ringtrain.live.redo`); `gradients.ids` are the
            samples this member's part of the last committed step covers.
    """
    # What this member holds from before a fault: the summands (`gradients.made` of a failed
    # attempt), the ids they cover and the step they are of.
    kept: list[torch.Tensor | None] | None = None
    held: list[int] = []
    held_step = -1
    regrouped = True  # the members changed: the next step's shares are agreed
    trained: list[int] = []
    try:
        if not group.join(state):
            return False
        while state.step < num_steps:
            try:
                # A step boundary: the only place the members may change.
                regrouped = group.admit(state) or regrouped
                if regrouped and gradients is not None:
                    if held_step != state.step:  # healed to another step: nothing held of it
                        kept, held = None, []
                    ids, _ = agree_shares(group.process_group, group.rank, state.batches,
                                          state.step, held)
                else:
                    ids = state.batches.share(state.step, group.rank, group.size)
                regrouped = False
                if gradients is not None:
                    gradients.held, gradients.made, trained = kept, None, held + ids
                result = step(ids, group.process_group)
            except (LiveMemberLostError, LiveRecoveryError):
                raise  # this process is out, or the error is not a lost peer: no retry
            except RuntimeError as error:  # a failed collective: a peer died or hangs
                if gradients is not None and gradients.made is not None:
                    kept, held, held_step = gradients.made, trained, state.step
                group.recover(state, error)
                regrouped = True
                continue
            state.step += 1
            state.commit()
            if gradients is not None:
                gradients.ids, kept, held = trained, None, []
            if on_commit is not None:
                on_commit(state.step - 1, result)
        return True
    finally:
        group.close()
