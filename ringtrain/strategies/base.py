"""The seam between the trainer and a way of distributing a model.

The trainer never asks which strategy it holds: it calls these methods on every rank, in the
same order, and reduces metrics as (sum, count) through the strategy's `agreement`. A rank
that has nothing to report (a pipeline stage without the loss, a parameter server) reports
count 0. Optional behaviour is a method here with a default that does nothing.

A strategy is one module in `ringtrain/strategies/` holding one `Strategy` subclass with a
`name`: the command line (`ringtrain train --strategy NAME`) finds it there, with its
`options` (its own flags), `plan` (its checks before any worker starts) and
`tolerated_ranks_for` (which ranks the launcher may lose), and `explain` (its words in
`ringtrain explain`). See docs/architecture.md.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringtrain.agreement.base import Agreement, CollectiveAgreement
from ringtrain.strategies.explaining import Explanation, RunFacts, generic
from ringtrain.trace import NO_TRACE, Tracer
from ringtrain.types import LossFn, OptimizerFn

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["EvalShard", "LossFn", "OptimizerFn", "Option", "ShardPerRank", "StepResult", "Strategy", "eval_forward",
           "int_at_least", "non_negative_float"]


@dataclass
class StepResult:
    """What one optimizer step did on this rank (sums, so the trainer can reduce them).

    `loss_sum` may be a 0-dim tensor on the device: the trainer converts it only on steps it
    logs, so a step that logs nothing never waits for the device (`ringtrain.strategies.step`).
    """

    loss_sum: float | torch.Tensor  # sum over this rank's samples of the per-sample mean loss
    count: int  # samples behind loss_sum; 0 where this rank computes no loss
    compute_s: float = 0.0  # forward + backward + optimizer time
    comm_s: float = 0.0  # time spent waiting on communication


@dataclass(frozen=True)
class EvalShard:
    """The part of the eval set this rank scores: shard `index` of `count` (exact, no padding).

    `index` None: this rank scores nothing but makes every `eval_logits` call the others make
    (a pipeline stage without the data, a parameter server in lockstep).
    """

    index: int | None
    count: int


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, with a message naming the value otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be {low} or more")
        return value
    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0, with a message naming the value otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # nan and inf too: "nan >= 0" is False
        raise argparse.ArgumentTypeError(f"{text} is not allowed: it must be a finite number, 0 or more")
    return value


@dataclass(frozen=True)
class Option:
    """One command-line option of a strategy: `flag` becomes the constructor's keyword `name`.

    Unset options are not passed: the constructor's default applies.
    """

    flag: str  # "--pp"
    name: str  # "pp"
    type: Callable[[str], Any] = str  # parses the text (an argparse type)
    choices: tuple[str, ...] | None = None
    help: str = ""

    @property
    def dest(self) -> str:
        """The attribute on the parsed arguments (`--ps-mode` -> `ps_mode`)."""
        return self.flag[2:].replace("-", "_")


class Strategy(ABC):
    """One rank's view of a distributed model. Call every method on every rank, same order."""

    name: str = ""
    options: tuple[Option, ...] = ()  # its own flags (`ringtrain train --help`, "strategy")
    # True when every rank holds the whole model and optimizer state (DDP): a snapshot is then
    # written once and can be resumed on any number of ranks. False: per-rank parts, same layout.
    replicated_state: bool = False
    tracer: Tracer = NO_TRACE  # spans of its steps (`ringtrain.trace`), set by `trace`

    # -- before any worker starts (the command line asks, with the options the user set) -------
    @classmethod
    def plan(cls, options: dict[str, Any], world_size: int, step_batch: int) -> int:
        """Check `options` against `world_size` ranks and a step of `step_batch` samples per
        data rank; return how many data ranks read data. Raises ConfigError naming the fix."""
        return world_size

    @classmethod
    def tolerated_ranks_for(cls, options: dict[str, Any], world_size: int) -> frozenset[int]:
        """Ranks whose death the job survives (the launcher keeps the others going)."""
        return frozenset()

    @classmethod
    def trainer_defaults(cls, options: dict[str, Any]) -> dict[str, Any]:
        """TrainerConfig defaults this strategy changes (e.g. AdamW's beta1), by field name."""
        return {}

    @classmethod
    def explain(cls, facts: RunFacts) -> Explanation:
        """What `ringtrain explain` says of a run of this strategy (roles, traffic, ...)."""
        return generic(facts)

    # -- the seam ------------------------------------------------------------------------------
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

    # -- optional, with defaults for lockstep strategies ----------------------------------------
    def agreement(self, runtime: Runtime, name: str) -> Agreement:
        """How this strategy's ranks agree on sums, votes and digests (`ringtrain.agreement`).

        `name` names store keys where the agreement uses the store (the trainer's name).
        Default: collectives over the world group (ranks move in step).
        """
        return CollectiveAgreement(runtime.process_group, runtime.world_size)

    def eval_shard(self) -> EvalShard | None:
        """The part of the eval set this rank scores; None: it takes no part in evaluation.

        Default: its data shard, every rank making the same number of `eval_logits` calls.
        """
        return EvalShard(self.data_rank, self.data_world_size)

    @property
    def is_worker(self) -> bool:
        """False on ranks that serve rather than train (parameter servers).

        The trainer still runs its loop on every rank, so world collectives (metrics, eval) line
        up: a non-worker reads no data, its `train_step` returns count 0 and its `eval_logits`
        returns None, while the strategy serves its peers inside those calls.
        """
        return True

    @property
    def tolerated_ranks(self) -> frozenset[int]:
        """Ranks whose death this job survives; `rank_departed` is told when one dies."""
        return frozenset()

    def rank_departed(self, rank: int, why: str) -> None:
        """A tolerated rank died (the watchdog found it): go on without it."""
        return None

    def trace(self, tracer: Tracer) -> None:
        """Record forward, backward, optimizer and communication spans into `tracer` (called
        before `setup`, which hands it to the engines)."""
        self.tracer = tracer

    def stats(self) -> dict[str, Any]:
        """The strategy's own figures for the run's summary (after `model_state_dict`)."""
        return {}

    def reshard_source(self, saved_world_size: int) -> int | None:
        """Resuming per-rank state saved by another number of ranks: which saved rank's part
        this rank loads; None (the default): the state cannot be resharded (refused, naming
        both world sizes). Replicated state (`replicated_state`) needs no answer."""
        return None

    def reshard_sources(self, saved_world_size: int) -> list[int] | None:
        """Resuming per-rank state saved by another number of ranks: every saved rank whose
        part this rank reads (`load_resharded_state_dict` gets them). Default: the one
        `reshard_source` names; None: it cannot be resharded."""
        source = self.reshard_source(saved_world_size)
        return None if source is None else [source]

    def load_resharded_state_dict(self, parts: dict[int, dict[str, Any]]) -> None:
        """Load per-rank state saved by another number of ranks: `parts` maps each saved rank of
        `reshard_sources` to its `state_dict()`. Default: `load_state_dict` of the one part."""
        (state,) = parts.values()
        self.load_state_dict(state)

    def serve(self) -> None:
        """Run a non-worker rank's role outside the trainer loop (optional)."""
        return None

    def close(self) -> None:
        """Release process groups and threads."""
        return None


class ShardPerRank:
    """Mixin for data-parallel strategies: every rank reads its own shard (rank r of world_size).

    List it before `Strategy`: `class DDPStrategy(ShardPerRank, Strategy)`.
    """

    runtime: Runtime

    @property
    def data_rank(self) -> int | None:
        return self.runtime.rank

    @property
    def data_world_size(self) -> int:
        return self.runtime.world_size


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
