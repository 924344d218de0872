"""Averaging a list of tensors over a group, with what travels in fp32, bf16 or int8.

    sent = average_([t1, t2], "int8", group, world_size)   # t1, t2 now hold the average

- fp32: one flat fp32 all-reduce (sum), then a division: exact up to the order of the sum.
- bf16: the flat tensor is cast to bf16 and all-gathered; every rank sums the N copies in fp32
  in rank order (a bf16 all-reduce would also add in bf16, losing the small pseudo-gradients).
- int8: each tensor is scaled by its own absolute maximum / 127 and rounded; the int8 values
  and the fp32 scales are all-gathered and summed in fp32 in rank order.
Every rank ends with bit-identical results in all three (the same numbers added in the same
order), so the replicas stay equal. On gloo and NCCL alike: only all_reduce and all_gather.
Returns the payload bytes this rank sent (a ring all-reduce sends 2 (N-1)/N of the buffer, an
all-gather N-1 times its own part), for the run's figures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives

CODECS = ("fp32", "bf16", "int8")


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _gather(t: torch.Tensor, group: dist.ProcessGroup | None,
            world_size: int) -> list[torch.Tensor]:

    parts = [torch.empty_like(t) for _ in range(world_size)]
    collectives.all_gather(parts, t, group=group)
    return parts


def average_(tensors: list[torch.Tensor], codec: str, group: dist.ProcessGroup | None,
             world_size: int) -> int:
    """Replace every tensor by its mean over the group's ranks; returns the bytes sent."""
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r}: choose one of {', '.join(CODECS)}")
    if not tensors:
        return 0
    flat = _flat(tensors)
    if world_size == 1:
        return 0
    if codec == "fp32":
        collectives.all_reduce(flat, group=group)
        flat.div_(world_size)
        sent = flat.numel() * 4 * 2 * (world_size - 1) // world_size
    elif codec == "bf16":
        parts = _gather(flat.to(torch.bfloat16), group, world_size)
        flat = torch.stack([p.float() for p in parts]).sum(0).div_(world_size)
        sent = flat.numel() * 2 * (world_size - 1)
    else:
        sizes = [t.numel() for t in tensors]
        scales = torch.stack([c.abs().max() for c in flat.split(sizes)]).clamp_(min=1e-30) / 127
        codes = torch.cat([(c / s).round_().clamp_(-127, 127)
                           for c, s in zip(flat.split(sizes), scales, strict=True)]).to(torch.int8)
        all_codes = _gather(codes, group, world_size)
        all_scales = _gather(scales, group, world_size)
        total = torch.zeros_like(flat)
        for c, s in zip(all_codes, all_scales, strict=True):  # rank order on every rank
            total += c.float() * torch.repeat_interleave(s, torch.tensor(sizes))
        flat = total.div_(world_size)
        sent = (codes.numel() + scales.numel() * 4) * (world_size - 1)
    _unflatten_into(flat, tensors)
    return sent
