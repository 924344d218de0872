"""What `DistributedDataParallel` does across ranks when it is built: check, then copy rank 0.

`verify_same_parameters` compares the parameters every rank wrapped (names, shapes, dtypes) and
says where they differ; `broadcast_coalesced` then copies rank 0's values to every rank in a few
large broadcasts (it also carries the buffers before a forward, and the model when a `Join`
ends). Parameters and buffers the module asks DDP to ignore (`ignored.py`) take part in neither:
they may differ between ranks.

Tests: `.venv/bin/pytest -q tests/test_ddp.py -k mismatch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.torch_internals import flatten_dense_tensors, unflatten_dense_tensors

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


class ReplicaMismatchError(ValueError, RuntimeError):
    """Ranks wrapped models whose parameters differ in name, shape or dtype.

    A RuntimeError as well, which is what torch's DDP raises for the same mistake
    (`_verify_param_shape_across_processes`).
    """


def verify_same_parameters(named: Sequence[tuple[str, torch.Tensor]],
                           process_group: dist.ProcessGroup) -> None:
    """Raise `ReplicaMismatchError` on every rank unless all ranks hold the same parameters.

    Args:
        named: (name, parameter) pairs in registration order, as `named_parameters()` gives
            them (a module works too: its `named_parameters()` are used).
        process_group: the ranks that must agree.

    Compares names, shapes and dtypes in registration order; the error names the first
    mismatching parameter and what each rank has there.
    """
    if isinstance(named, torch.nn.Module):
        named = list(named.named_parameters())
    mine = [(name, tuple(p.shape), str(p.dtype).replace("torch.", "")) for name, p in named]
    world_size = process_group.size()
    everyone: list[Any] = [None] * world_size
    collectives.all_gather_object(everyone, mine, group=process_group)
    if all(sig == everyone[0] for sig in everyone):
        return
    longest = max(len(sig) for sig in everyone)
    for k in range(longest):
        at_k = [sig[k] if k < len(sig) else None for sig in everyone]
        if any(entry != at_k[0] for entry in at_k):
            break
    groups: dict[Any, list[int]] = {}
    for rank, entry in enumerate(at_k):
        groups.setdefault(entry, []).append(rank)
    described = "; ".join(
        f"ranks {ranks} have " + ("no parameter there" if entry is None else
                                  f"{entry[0]!r} shape={list(entry[1])} dtype={entry[2]}")
        for entry, ranks in groups.items()
    )
    counts = {len(sig) for sig in everyone}
    sizes = "" if len(counts) == 1 else (
        " Parameter counts per rank: " + str([len(sig) for sig in everyone]) + ".")
    raise ReplicaMismatchError(
        f"DistributedDataParallel needs the same parameters on every rank, but parameter #{k} "
        f"differs: {described}.{sizes} Build the same model (same config, same registration "
        "order) on every rank before wrapping it."
    )


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int,
                        process_group: dist.ProcessGroup,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
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
