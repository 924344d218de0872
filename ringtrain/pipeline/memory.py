"""Activation memory of a pipeline stage: bytes autograd saves for backward, held per
micro-batch (and chunk) until its backward frees them. `StepStats.peak_activation_bytes` and the
benchmark's memory column come from here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ActivationMeter:
    """Counts bytes of tensors autograd saves for backward, per micro-batch, to report the
    peak held at once. A tensor saved twice (a ReLU output is also the next Linear's input)
    counts once; parameters (and views of them, such as a transposed weight) not at all.
    Views count their own bytes, not their base's: a micro-batch is a view of the batch."""

    def __init__(self, module: nn.Module):
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.per_mb: dict[object, dict[tuple, int]] = {}
        self.live = self.peak = 0

    def add(self, mb: object, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self.param_storages:
            return
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        held = self.per_mb.setdefault(mb, {})
        if key not in held:
            held[key] = t.numel() * t.element_size()
            self.live += held[key]
            self.peak = max(self.peak, self.live)

    @contextlib.contextmanager
    def saving(self, mb: object):
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(mb, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, mb: object) -> None:
        self.live -= sum(self.per_mb.pop(mb, {}).values())

