"""Dropout under tensor parallelism: the same mask where the tp ranks hold one activation
whole, different masks where each holds its own part (Megatron-LM's RNG tracker, in effect).

    with sharded_rng(group):          # this rank's heads, or its tokens under SP
        y = F.dropout(x, p, training=True)

The ranks of a tp group draw from one random stream (`--strategy tp` seeds them alike): a
dropout on an activation every rank holds whole (the embedding's output, a residual branch
after an all-reduce) then draws the same mask on each, as it must, or the copies part. Where
each rank holds a different part (its attention heads; its slice of the sequence under
sequence parallelism) the same stream would give every part the same mask: head h on rank 0
and head h + H/t on rank 1 dropped alike. `sharded_rng` draws those from a stream of this
rank's own, seeded from one draw of the shared CPU stream plus the tp rank, then puts the
shared streams back as they were.

Why a draw and not a tracker's saved state (Megatron's): torch's activation checkpointing
(`torch.utils.checkpoint`, `GPTConfig(activation_checkpointing=True)`) restores the default
CPU and device generators before it recomputes a block, so the draw, and with it every mask of
the recompute, is the forward's again; a generator state of our own would have moved on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ringtrain.tensor_parallel import comm


@contextmanager
def sharded_rng(group, device: torch.device | None = None) -> Iterator[None]:
    """Random draws inside differ per rank of `group` (and are reproduced by a recompute);
    outside, the shared streams are as if nothing had been drawn but one CPU number."""
    draw = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # the shared CPU stream
    seed = int(np.random.SeedSequence([draw, comm.group_rank(group)]).generate_state(1)[0])
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:  # that device's generator only (torch.manual_seed would reseed every GPU's)
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


class ShardedDropout(nn.Module):
    """`nn.Dropout` on an activation each tp rank holds a different part of (its tokens under
    sequence parallelism): masks from `sharded_rng`."""

    def __init__(self, p: float, group):
        super().__init__()
        self.p, self.group = p, group

    @classmethod
    def from_dropout(cls, dropout: nn.Module, group) -> nn.Module:
        """`dropout` itself where it drops nothing; else its sharded form."""
        p = getattr(dropout, "p", 0.0)
        return cls(p, group) if isinstance(dropout, nn.Dropout) and p > 0 else dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        with sharded_rng(self.group, x.device):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, tp={comm.group_size(self.group)}"
