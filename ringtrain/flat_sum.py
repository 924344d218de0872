"""One flat all-reduce of many tensors: `flat_all_reduce(group, parts, like)`.

    views = flat_all_reduce(group, [p.grad for p in params], params)   # None: zeros
    for p, v in zip(params, views): p.grad = v

Gloo sums a buffer in place, so the parts are concatenated into a new one and summed there: the
parts themselves are left as they were, which is what lets a live member keep its summands
through a failed all-reduce (`ringtrain.live.redo`, `ringtrain.strategies.live_step`). One call
per step instead of one per tensor; the results are views of the summed buffer, not copies.
The group's own `allreduce`: a live generation's group is outside torch's registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["add_held", "flat_all_reduce"]


def add_held(parts: Sequence[torch.Tensor | None], held: Sequence[torch.Tensor | None]
             ) -> list[torch.Tensor | None]:
    """Each part plus the held one at its place (None: nothing there), in place in the part:
    a redone step's new summands and those kept from before a fault, added once."""
    return [k if g is None else g if k is None else g.add_(k)
            for g, k in zip(parts, held, strict=True)]


def flat_all_reduce(group: Any, parts: Sequence[torch.Tensor | None],
                    like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Sum `parts` (None: zeros shaped as `like`'s tensor at its place) over `group`; return
    each one's sum as a view of one flat buffer, shaped as `like`."""
    flat = torch.cat([(t if t is not None else torch.zeros_like(ref)).reshape(-1)
                      for t, ref in zip(parts, like, strict=True)])
    group.allreduce([flat]).wait()
    out, offset = [], 0
    for ref in like:
        out.append(flat[offset:offset + ref.numel()].view_as(ref))
        offset += ref.numel()
    return out
