"""The seam between the trainer and a way of distributing a model.

The trainer never asks which strategy it holds: it calls these methods on every rank, in the
same order, and reduces metrics as (sum, count) over the world group. A rank that has nothing
to report (a pipeline stage without the loss, a parameter server) reports count 0.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.errors import ConfigError

# --strategy name -> "module:Class"; modules are imported only when chosen.
STRATEGIES: dict[str, str] = {
    "ddp": "ringtrain.strategies.ddp:DDPStrategy",
    "pipeline": "ringtrain.strategies.pipeline:PipelineStrategy",
    "ps": "ringtrain.strategies.ps:PSStrategy",
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StepResult:
    """What one optimizer step did on this rank (sums, so the trainer can reduce them)."""

    loss_sum: float  # sum over this rank's samples of the per-sample mean loss
    count: int  # samples behind loss_sum; 0 where this rank computes no loss
    compute_s: float = 0.0  # forward + backward + optimizer time
    comm_s: float = 0.0  # time spent waiting on communication


class Strategy(ABC):
    """One rank's view of a distributed model. Call every method on every rank, same order."""

    name: str = ""
    # True when every rank holds the whole model and optimizer state (DDP): a snapshot is then
    # written once and can be resumed on any number of ranks. False: per-rank parts, same layout.
    replicated_state: bool = False
    # False when ranks may legitimately drift apart in steps (async/ssp parameter server): the
    # trainer then asks for agreement (SIGTERM, stop) at metric steps only, which all ranks share.
    lockstep: bool = True

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        """Take the plain model (identically initialised on every rank) and build the optimizer."""

    @property
    @abstractmethod
    def data_rank(self) -> int | None:
        """Which data shard this rank reads (sampler rank); None when it reads no data."""

    @property
    @abstractmethod
    def data_world_size(self) -> int:
        """How many data shards there are (sampler num_replicas)."""

    @abstractmethod
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        """Forward/backward every micro-batch (gradient accumulation), sync, clip, step."""

    @abstractmethod
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits for `x` under no_grad; None on ranks that produce no output."""

    @abstractmethod
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unwrapped model state (no `module.` prefix), equal on every rank."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this rank's part: model, optimizer."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""

    @property
    def is_worker(self) -> bool:
        """False on ranks that serve rather than train (parameter servers).

        The trainer still runs its loop on every rank, so world collectives (metrics, eval) line
        up: a non-worker reads no data, its `train_step` returns count 0 and its `eval_logits`
        returns None, while the strategy serves its peers inside those calls.
        """
        return True

    def serve(self) -> None:
        """Run a non-worker rank's role outside the trainer loop (optional)."""
        return None

    def close(self) -> None:
        """Release process groups and threads."""
        return None


@torch.no_grad()
def eval_forward(module: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`module(x)` in eval mode (no dropout), putting the module back in its mode afterwards.

    The plain module, not a DDP wrapper: evaluation needs no collective.
    """
    was_training = module.training
    module.eval()
    try:
        return module(x.to(device))
    finally:
        module.train(was_training)


def make_strategy(name: str, **options: Any) -> Strategy:
    """Build the strategy registered as `name` with its options (e.g. pp=2, schedule='1f1b')."""
    if name not in STRATEGIES:
        raise ConfigError(f"--strategy {name!r} is not known; choose one of {sorted(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)
