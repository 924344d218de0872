"""The callables users hand to ringtrain, named once (the bottom module: it imports only torch).

    loss_fn: LossFn = torch.nn.functional.cross_entropy-like: (logits, targets) -> mean loss
    optimizer_fn: OptimizerFn = lambda params: torch.optim.AdamW(params, lr=1e-3)
    metric: MetricFn = (logits, targets) -> one value per sample (accuracy, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> per sample

__all__ = ["LossFn", "MetricFn", "OptimizerFn"]
