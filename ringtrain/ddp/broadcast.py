"""Rank `src`'s tensors to every rank in a few flat broadcasts (parameters and buffers).

Used where DDP makes the replicas equal: at construction (rank 0's parameters and buffers), before
a forward that follows a synced one (the buffers, `distributed.py`) and when a `Join` ends (the
last rank to join, `join.py`). Tests: `.venv/bin/pytest -q tests/test_ddp.py`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.torch_internals import flatten_dense_tensors, unflatten_dense_tensors

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int,
                        process_group: dist.ProcessGroup,
                        bucket_bytes: int = _BROADCAST_BUCKET_BYTES) -> None:
    """Overwrite `tensors` on every rank with rank `src`'s values, a few large broadcasts.

    Tensors are grouped by (dtype, device) and flattened into chunks of about `bucket_bytes`,
    so a model with hundreds of small buffers costs a handful of collectives, not hundreds.
    `src` is a rank within `process_group`.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    src_global = (dist.get_global_rank(process_group, src) if process_group != dist.group.WORLD
                  else src)
    is_src = process_group.rank() == src
    for chunk in _chunks(groups, bucket_bytes):
        flat = flatten_dense_tensors([t.detach() for t in chunk])
        collectives.broadcast(flat, src_global, group=process_group)
        if not is_src:
            for t, synced in zip(chunk, unflatten_dense_tensors(flat, chunk), strict=True):
                t.detach().copy_(synced)


def _chunks(groups: dict, bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    for tensors in groups.values():
        chunk, size = [], 0
        for t in tensors:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk
