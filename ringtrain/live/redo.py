"""A step redone after a fault trains only what nobody holds: the lost members' shares.

    gradients = LiveGradients(model)      # keeps each step's summands through a failed all-reduce
    def step(ids, process_group):
        loss = model_loss(ids) / batches.global_batch_size      # this share's part of the mean
        loss.backward()
        total = gradients.all_reduce(process_group, loss)       # sums, the held part added
        optimizer.step(); optimizer.zero_grad()
        return float(total)
    train_live(group, state, step, num_steps, gradients=gradients)

When a peer dies, the survivors have computed their shares of the step already: the failure
is found in the all-reduce, after the backward. Gloo reduces in place, but the buffer it
reduces is a concatenation of the gradients, so the gradients themselves are the member's
summands as they were: kept, they cost no copy. The next generation agrees on who holds which
samples (`agree_shares`: one all-gather of ids) and trains only the rest, split as
`GlobalBatches.redo_shares` says: 4 -> 3 members redo a third of a share each instead of the
whole step over 3, and a spare in the lost member's place trains exactly its share, so the
all-reduce over the same ranks gives the fault-free sums bit for bit.

`ringtrain train --live` does the same through `LiveHooks.contribution` (ddp's hooks,
`ringtrain.strategies.live_step`) and `agree_shares`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.flat_sum import add_held, flat_all_reduce
from ringtrain.live.batches import GlobalBatches

__all__ = ["LiveGradients", "agree_shares", "gather_ids"]


def agree_shares(process_group: dist.ProcessGroup, rank: int, batches: GlobalBatches,
                 step: int, held: list[int]) -> tuple[list[int], int]:
    """This member's ids to train of `step` in a new generation, and how many samples of it
    the members hold from before a fault (0: nobody, the plain shares).

    Args:
        process_group: the generation's group (its own methods: outside torch's registry).
        rank: this member's rank in it.
        batches: the job's global batches.
        step: the step about to be trained (0-based).
        held: the ids whose summands this member holds of `step` (empty: none).
    """
    holding = gather_ids(process_group, held, batches.global_batch_size)
    return batches.redo_shares(step, holding)[rank], sum(len(h) for h in holding)


def gather_ids(process_group: dist.ProcessGroup, ids: list[int], most: int) -> list[list[int]]:
    """Every member's list of sample ids (at most `most` each), by rank: one all-gather of a
    length and the ids, padded to one width (the group's own method)."""
    if len(ids) > most:
        raise ValueError(f"{len(ids)} ids ({ids[:8]}...) to gather, at most {most}: a member "
                         "holds at most one global batch of a step")
    mine = torch.full((most + 1,), -1, dtype=torch.int64)
    mine[0] = len(ids)
    mine[1:1 + len(ids)] = torch.tensor(ids, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(process_group.size())]
    process_group.allgather([out], [mine]).wait()
    return [t[1:1 + int(t[0])].tolist() for t in out]


class LiveGradients:
    """A model's gradients summed over the group, this step's summands kept (see module doc).

    Attributes:
        made: the summands of the last `all_reduce` (None before one, or once the loop
            starts a new attempt).
        held: summands of the step being redone, added by the next `all_reduce` (set by the
            loop).
        ids: the samples this member's part of the last committed step covers (set by the
            loop: its share, or after a fault what it held and what it trained again).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.made: list[torch.Tensor | None] | None = None
        self.held: list[torch.Tensor | None] | None = None
        self.ids: list[int] = []  # the samples of this member's part of the last committed step

    def all_reduce(self, process_group: dist.ProcessGroup,
                   loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """Sum every parameter's gradient (None: zeros) plus what is held, in one flat
        all-reduce; each gradient becomes its view of the sum. `loss` (this member's part of
        the global loss, a scalar) rides in the same buffer and is kept with the gradients:
        its sum over the group, held parts included, is returned (None without one)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        parts = [p.grad for p in params] + [loss.detach().reshape(1) if loss is not None
                                            else None]
        if self.held is not None:  # the same step from before a fault: added once
            parts, self.held = add_held(parts, self.held), None
        self.made = parts
        like = [*params, torch.zeros(1, dtype=params[0].dtype, device=params[0].device)]
        *grads, total = flat_all_reduce(process_group, parts, like)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return total[0] if loss is not None else None
