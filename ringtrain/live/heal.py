"""Healing: the members behind take the committed state of a member at the newest step.

    heal(state, process_group, rank)       # every member of a new generation, together

torchft's "heal from a live peer", over the new group instead of from disk. Each member says
which step it has committed (one all-gather of an int); the first member at the highest step
is the source. When every member is there already (survivors that all failed in the same step)
nothing moves. Otherwise the source broadcasts its committed state (model, optimizer, step,
batches, RNG: `LiveState.state_dict()`) and every member loads it, so the group leaves the call
with identical state. Taking the highest step, not the lowest, also settles a failure that hit
after some members had already stepped: their step completed its all-reduce with every
member's gradients, so it is the fault-free step and the others catch up to it.

The state travels as one serialized buffer (`torch.save`, a size then the bytes): simple, and
the receivers need no idea of the optimizer state's shapes (a fresh Adam has none yet). A
large model would broadcast its tensors in place instead, bucketed; that is not done yet.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain.live.state import LiveState


@dataclass(frozen=True)
class HealReport:
    """What a heal did: the source's position, the step healed to, bytes broadcast (0: none)."""

    source: int
    step: int
    nbytes: int


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    # The group's own method: dist.broadcast wants src as a rank of a registered group, and a
    # live generation's group is built directly, never registered with the default group.
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def heal(state: LiveState, group: dist.ProcessGroup, rank: int,
         committed_step: int | None = None) -> HealReport:
    """Bring every member of `group` to the committed state of the member at the newest step.

    Args:
        state: this member's state (already `restore()`d to its last commit).
        group: the new generation's process group; `rank` is this member's rank in it.
        committed_step: this member's step; -1 for a replacement that has none yet. Default:
            `state.committed_step`.
    """
    mine = state.committed_step if committed_step is None else committed_step
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([steps], [torch.tensor([mine], dtype=torch.int64)]).wait()
    by_rank = [int(s) for s in steps]
    newest = max(by_rank)
    source = by_rank.index(newest)
    if min(by_rank) == newest:
        return HealReport(source, newest, 0)
    if rank == source:
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size, source)
    if rank != source:
        payload = torch.empty(int(size), dtype=torch.uint8)
    _broadcast(group, payload, source)
    if rank != source and by_rank[rank] != newest:
        received = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        state.load_state_dict(received)
    return HealReport(source, newest, int(size))
