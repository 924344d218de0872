"""A state's large tensors taken out of its structure and put back, to send it between ranks.

    large = []
    skeleton = split_large(state, large)   # large tensors -> meta placeholders, in walk order
    # send `skeleton` pickled (small), then each tensor of `large` in that order
    into = []
    state = fill_large(skeleton, into)     # placeholders -> new CPU tensors; receive into `into`

    state = send_recv_state(group, mine, dst=1, src=2)   # both at once, over a process group

Used by a live replacement's heal from a peer (`ringtrain.live.heal`), by local SGD's copy
of a member's inner optimizer state to its ring successor (`strategies/localsgd_live.py`) and
by live ZeRO's copy of a member's optimizer shard to its buddy (`strategies/zero_live.py`): a
pickle of a gigabyte of tensors costs seconds, a broadcast of the tensors themselves does not.
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["INLINE_BYTES", "fill_large", "send_recv_state", "split_large"]

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


def fill_large(obj: Any, large: list[torch.Tensor], reuse: Any = None) -> Any:
    """`obj` with each meta tensor replaced by a CPU tensor to receive into (appended to `large`).

    `reuse`: a structure like `obj` whose tensors may be received into where one at the same
    place is a contiguous CPU tensor of the same shape and dtype (a replacement's own
    parameters: memory it has touched already, not new pages); elsewhere a new tensor.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            return obj
        if (isinstance(reuse, torch.Tensor) and reuse.device.type == "cpu"
                and reuse.shape == obj.shape and reuse.dtype == obj.dtype
                and reuse.is_contiguous()):
            large.append(reuse)
        else:
            large.append(torch.empty(obj.shape, dtype=obj.dtype))
        return large[-1]
    if isinstance(obj, dict):
        theirs = reuse if isinstance(reuse, dict) else {}
        return type(obj)((k, fill_large(v, large, theirs.get(k))) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        same = isinstance(reuse, list | tuple) and len(reuse) == len(obj)
        return type(obj)(fill_large(v, large, reuse[i] if same else None)
                         for i, v in enumerate(obj))
    return obj


def send_recv_state(pg: Any, state: Any, *, dst: int | None, src: int | None) -> Any:
    """Send `state` to rank `dst` of `pg` and receive one from rank `src`, both at once (a
    ring's members all send before they receive); either may be None (then it returns None).
    The structure travels pickled with the small tensors; each large tensor as it is, into one
    the receiver allocates (nothing the size of the moments is pickled or copied). `pg`'s own
    methods: a live generation's group is outside torch's registry."""
    large: list[torch.Tensor] = []
    skeleton = _serialize(split_large(state, large)) if dst is not None else None
    size = torch.zeros(1, dtype=torch.int64)
    _wait([pg.send([torch.tensor([skeleton.numel()])], dst, 0)] if skeleton is not None else [],
          [pg.recv([size], src, 0)] if src is not None else [])
    theirs = torch.empty(int(size), dtype=torch.uint8)
    _wait([pg.send([skeleton], dst, 1)] if skeleton is not None else [],
          [pg.recv([theirs], src, 1)] if src is not None else [])
    into: list[torch.Tensor] = []
    received = fill_large(_deserialize(theirs), into) if src is not None else None
    _wait([pg.send([t], dst, 2 + i) for i, t in enumerate(large)],
          [pg.recv([t], src, 2 + i) for i, t in enumerate(into)])
    return received


def _wait(*works: list[Any]) -> None:
    for group in works:
        for work in group:
            work.wait()


def _serialize(state: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _deserialize(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
