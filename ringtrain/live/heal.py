"""Healing: the members behind take the committed state of a member at the newest step.

    heal(state, process_group, rank)       # every member of a new generation, together

torchft's "heal from a live peer", over the new group instead of from disk. Each member says
which step it has committed and which it trains next (one all-gather of two ints: the second
is ahead of the first while a local SGD round is redone, and the report's `target` tells a
replacement where its peers go on from); the first member at the highest step
is the source. When every member is there already (survivors that all failed in the same step)
nothing moves. Otherwise the source sends its committed state (model, optimizer, step,
batches, RNG: `LiveState.state_dict()`) and every member loads it, so the group leaves the call
with identical state. Taking the highest step, not the lowest, also settles a failure that hit
after some members had already stepped: their step completed its all-reduce with every
member's gradients, so it is the fault-free step and the others catch up to it.

How it travels: the large tensors (weights, the optimizer's moments) are broadcast one by one,
in place, from the source's committed tensors into tensors the receivers allocate; everything
else (the structure, with each large tensor replaced by a `meta` tensor of its shape and dtype,
and the small tensors and values) goes first as one small pickled buffer. So the receivers need
no idea of the optimizer state's shapes beforehand (a fresh AdamW has none), and nothing the
size of the model is pickled, copied into a buffer or unpickled (100 M parameters with AdamW:
1.2 GB; docs/fault_tolerance.md has the seconds).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain.live.state import LiveState
from ringtrain.tensor_tree import fill_large, split_large


@dataclass(frozen=True)
class HealReport:
    """What a heal did: the source's position, the step healed to, bytes broadcast (0: none),
    and the seconds it took on this member (the step agreement included)."""

    source: int
    step: int
    nbytes: int
    seconds: float = 0.0
    target: int = 0  # the members' newest `LiveState.target`: where they all train next


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    # The group's own method: dist.broadcast wants src as a rank of a registered group, and a
    # live generation's group is built directly, never registered with the default group.
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _send_bytes(group: dist.ProcessGroup, payload: bytes | None, src: int) -> bytes:
    """Broadcast a byte string from `src` (a size, then the bytes); every member returns it."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    _broadcast(group, size, src)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
           else torch.empty(int(size), dtype=torch.uint8))
    _broadcast(group, buf, src)
    return buf.numpy().tobytes()


def heal(state: LiveState, group: dist.ProcessGroup, rank: int,
         committed_step: int | None = None) -> HealReport:
    """Bring every member of `group` to the committed state of the member at the newest step.

    Args:
        state: this member's state (already `restore()`d to its last commit).
        group: the new generation's process group; `rank` is this member's rank in it.
        committed_step: this member's step; -1 for a replacement that has none yet. Default:
            `state.committed_step`.
    """
    start = time.perf_counter()
    mine = state.committed_step if committed_step is None else committed_step
    target = -1 if committed_step == -1 else max(state.target, mine)
    steps = [torch.zeros(2, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([steps], [torch.tensor([mine, target], dtype=torch.int64)]).wait()
    by_rank = [int(s[0]) for s in steps]
    newest = max(by_rank)
    source = by_rank.index(newest)
    target = max(newest, *(int(s[1]) for s in steps))
    if min(by_rank) == newest:
        return HealReport(source, newest, 0, time.perf_counter() - start, target)
    large: list[torch.Tensor] = []
    payload = None
    if rank == source:
        buf = io.BytesIO()
        torch.save(split_large(state.state_dict(), large), buf)
        payload = buf.getvalue()
    payload = _send_bytes(group, payload, source)
    received = None
    if rank != source:
        # A replacement (nothing committed, `mine` -1) receives into its commit's tensors where
        # they fit (its parameters, and the optimizer state `LiveState.prepare_heal` made):
        # memory it touched before it was let in, where new pages would fault in inside the
        # stall (issue 26: 1.2 GB placed anew took seconds on a VM that takes idle memory
        # back). A member with a commit keeps it intact until the heal has completed: if
        # the source dies half way, that commit may be the newest left, and must be whole.
        received = fill_large(torch.load(io.BytesIO(payload), weights_only=True), large,
                              state.state_dict() if mine == -1 else None)
    for tensor in large:  # the same order everywhere: the structure's, as walked by _split
        _broadcast(group, tensor, source)
    if received is not None and by_rank[rank] != newest:
        state.load_state_dict(received, adopt=True)
    return HealReport(source, newest, len(payload) + sum(t.nbytes for t in large),
                      time.perf_counter() - start, target)
