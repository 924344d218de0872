"""A state's large tensors taken out of its structure and put back, to send it between ranks.

    large = []
    skeleton = split_large(state, large)   # large tensors -> meta placeholders, in walk order
    # send `skeleton` pickled (small), then each tensor of `large` in that order
    into = []
    state = fill_large(skeleton, into)     # placeholders -> new CPU tensors; receive into `into`

Used by a live replacement's heal from a peer (`ringtrain.live.heal`) and by local SGD's copy
of a member's inner optimizer state to its ring successor (`strategies/localsgd_live.py`): a
pickle of a gigabyte of tensors costs seconds, a broadcast of the tensors themselves does not.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INLINE_BYTES", "fill_large", "split_large"]

INLINE_BYTES = 1 << 16  # a tensor smaller than this travels inside the pickled structure


def split_large(obj: Any, large: list[torch.Tensor]) -> Any:
    """`obj` with each large tensor replaced by a meta tensor (appended to `large`, in order)."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() * obj.element_size() < INLINE_BYTES:
            return obj
        large.append(obj.contiguous())
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return type(obj)((k, split_large(v, large)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(split_large(v, large) for v in obj)
    return obj


def fill_large(obj: Any, large: list[torch.Tensor]) -> Any:
    """`obj` with each meta tensor replaced by a new CPU tensor (appended to `large`)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            return obj
        large.append(torch.empty(obj.shape, dtype=obj.dtype))
        return large[-1]
    if isinstance(obj, dict):
        return type(obj)((k, fill_large(v, large)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(fill_large(v, large) for v in obj)
    return obj
