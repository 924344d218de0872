"""The outer step: where the workers, after H local steps each, meet and agree on one model.

    sent = average_weights(params, group, world_size)          # local SGD: the plain mean
    outer = OuterStep(params, lr=0.7, momentum=0.9, codec="fp32")
    sent = outer.step(params, group, world_size)               # DiLoCo: pseudo-gradient + Nesterov

`average_weights` is the reference: every parameter replaced by its mean over the workers.
`OuterStep` keeps the weights of the last outer step (`anchor`, the same on every rank) and an
outer SGD optimizer over them; its step all-reduces the pseudo-gradient `anchor - params`
(optionally compressed, `ringtrain.localsgd.compress`), lets the outer optimizer move the
anchor, and copies the anchor into the worker's parameters. With lr 1 and no momentum it is
local SGD: anchor - (anchor - mean(params)) = mean(params), up to rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.localsgd.compress import average_


@torch.no_grad()
def average_weights(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None,
                    world_size: int) -> int:
    """Local SGD's meeting: each parameter becomes the mean over the ranks (fp32 all-reduce)."""
    return average_(list(params), "fp32", group, world_size)


class OuterStep:
    """DiLoCo's outer optimizer over the anchor weights (Douillard et al. 2023, algorithm 1).

    Args:
        params: the worker's parameters, identical on every rank when this is built.
        lr: outer learning rate (the paper's 0.7).
        momentum: outer Nesterov momentum (the paper's 0.9); 0 for plain SGD.
        codec: how the pseudo-gradient travels: "fp32", "bf16" or "int8".
    """

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float = 0.7, momentum: float = 0.9,
                 codec: str = "fp32"):
        self.anchor = [p.detach().clone() for p in params]
        self.codec = codec
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)

    @torch.no_grad()
    def step(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
             world_size: int) -> int:
        """One outer step on every rank; returns the bytes this rank sent."""
        deltas = [a - p for a, p in zip(self.anchor, params, strict=True)]  # the pseudo-gradient
        sent = average_(deltas, self.codec, group, world_size)
        for a, d in zip(self.anchor, deltas, strict=True):
            a.grad = d
        self.optimizer.step()
        for a, p in zip(self.anchor, params, strict=True):
            a.grad = None
            p.copy_(a)
        return sent

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.clone() for a in self.anchor],
                "optimizer": self.optimizer.state_dict()}


    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for a, saved in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
