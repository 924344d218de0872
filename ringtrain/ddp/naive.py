"""The naive data parallel: after backward, one all-reduce per parameter. The reference.

Everything `ringtrain.DistributedDataParallel` does, minus the engineering: no buckets, no
overlap with backward, no hooks. Same start (rank 0's weights everywhere), same result (each
gradient averaged over ranks). Tests and `benchmarks/ddp_vs_torch.py` compare against it.

    model = NaiveDistributedDataParallel(model)
    model(x).sum().backward()
    model.sync_gradients()        # the whole algorithm
    optimizer.step()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class NaiveDistributedDataParallel(nn.Module):
    """Replicas that average their gradients when asked, one parameter at a time.

    Args:
        module: the model, identically built on every rank.
        process_group: the group to average over; default: the world group.

    Gradient accumulation needs nothing special: call `sync_gradients()` only after the last
    micro-batch's backward.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.process_group = dist.group.WORLD if process_group is None else process_group
        src = (0 if self.process_group == dist.group.WORLD
               else dist.get_global_rank(self.process_group, 0))

        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src, group=self.process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average every parameter's `.grad` over the group (a missing grad counts as zero)."""
        world_size = self.process_group.size()
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must join every all-reduce
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad.div_(world_size)
