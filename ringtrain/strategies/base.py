"""The seam between the trainer and a way of distributing a model.

The trainer never asks which strategy it holds: it calls these methods on every rank, in the
same order, and reduces metrics as (sum, count) through the strategy's `agreement`. A rank
that has nothing to report (a pipeline stage without the loss, a parameter server) reports
count 0. Optional behaviour is a method here with a default that does nothing.

A strategy is one module in `ringtrain/strategies/` holding one `Strategy` subclass with a
`name` and a `Config` (a `StrategyConfig` dataclass): the command line (`ringtrain train
--strategy NAME`) finds it there; the config holds its own flags (one field each), `plan` (its
checks before any worker starts), `tolerated_ranks` (which ranks the launcher may lose),
`trainer_defaults`, and `figures` (what a rank holds and sends, in numbers: `figures.py`; the
words of `ringtrain explain` are the command's). `Strategy` itself is only what a rank does at
run time. See docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ringtrain.agreement.base import Agreement, CollectiveAgreement
from ringtrain.agreement.generations import GenerationAgreement
from ringtrain.config import check_values
from ringtrain.trace import NO_TRACE, Tracer
from ringtrain.types import LossFn, OptimizerFn

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime
    from ringtrain.strategies.figures import Figures, Workload

__all__ = ["EvalShard", "LiveHooks", "LossFn", "OptimizerFn", "ShardPerRank", "StepResult",
           "Strategy", "StrategyConfig", "UpdatedState", "eval_forward"]


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
class UpdatedState:
    """Tensors of a strategy's `state_dict()` that nothing but `optimizers`' `step()` changes in
    place (parameters, optimizer moments): not the forward, not the backward, not a collective
    between steps. A background snapshot copies them beside the next step's forward and
    backward, and the optimizers' next `step()` waits for the copy (`ringtrain.checkpoint.
    host_copy`). State left out (buffers a forward changes: BatchNorm's running stats, DDP's
    broadcast of buffers) is copied in the snapshot's own step.
    """

    tensors: list[torch.Tensor]
    optimizers: list[torch.optim.Optimizer]


@dataclass(frozen=True)
class EvalShard:
    """The part of the eval set this rank scores: shard `index` of `count` (exact, no padding).

    `index` None: this rank scores nothing but makes every `eval_logits` call the others make
    (a pipeline stage without the data, a parameter server in lockstep).
    """

    index: int | None
    count: int


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """A strategy's own options, one `ringtrain.config.option` field per flag, and what the
    command line asks of them before any worker starts. Its defaults are the strategy's: an
    option the user did not set keeps them. Subclass it next to the strategy, as `Config`.
    """

    # Options that choose this strategy when --strategy is not given (`--pp 2` alone means
    # `--strategy pipeline --pp 2`); the first strategy by name with one of them given wins.
    chosen_by: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        # Values from Python, a recipe or config.json get the command line's checks (a field's
        # type and choices), so `ZeroConfig(zero_stage=4)` fails here, naming the field.
        check_values(self)

    def kwargs(self) -> dict[str, Any]:
        """The strategy constructor's keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def plan(self, world_size: int, step_batch: int) -> int:
        """Check these options against `world_size` ranks and a step of `step_batch` samples
        per data rank; return how many data ranks read data. Raises ConfigError naming the fix."""
        return world_size

    def check_model(self, model: Any, sequence_length: int | None = None,
                    vocab_size: int | None = None) -> None:
        """Check these options against the model's (`n_head`, `tie_embeddings`, `dropout`...:
        the command line's model options), the task's tokens per sample and the model's
        vocabulary rows (the data's tokens, padded), where known, before any worker starts.
        Raises ConfigError naming the fix. Default: every model fits."""
        return None

    def tolerated_ranks(self, world_size: int) -> frozenset[int]:
        """Ranks whose death the job survives (the launcher keeps the others going)."""
        return frozenset()

    def trainer_defaults(self) -> dict[str, Any]:
        """TrainerConfig defaults this strategy changes (e.g. AdamW's beta1), by field name."""
        return {}

    def live_refusal(self) -> str | None:
        """Why `--live` cannot run with these options (the reason and the fix), checked before
        any worker starts; None: it can (the strategy's `live_hooks` gives its step).
        Default: refused, for a strategy without live recovery."""
        return ("it has no live recovery yet (survivors would not know how to rebuild its "
                "state over fewer ranks): drop --live (a failure then restarts every worker "
                "from the last snapshot, --max-restarts), or use --strategy ddp, zero, localsgd "
                "or diloco")

    def figures(self, workload: Workload) -> Figures | None:
        """What a rank holds and sends under these options (`ringtrain.strategies.figures`),
        for `ringtrain explain`; None (the default): not estimated. Raises ConfigError where
        `plan` does."""
        return None


class LiveHooks(ABC):
    """A strategy's part in live recovery: its state, and a step over the current members."""

    model: nn.Module  # the plain module every member replicates (committed and healed)
    optimizer: Any  # its optimizer (committed and healed with it)
    # True where `train_step` changes the model and optimizer only after its last collective
    # (ddp: the gradients' all-reduce, then the optimizer's step): a step that fails leaves
    # them as committed, so a commit keeps the live tensors, not a copy of them
    # (`LiveState(in_place=True)`). False (the default): a copy per commit.
    commits_in_place: bool = False

    def agreement(self, current: Callable[[], Runtime]) -> GenerationAgreement:
        """How the loop's sums, votes and digests are agreed over the current generation
        (`current()`: this member's place now), keeping a failed question for the driver
        (`take_failure`). Default: its group's collectives."""
        return GenerationAgreement(current)

    def commits_at(self, step: int) -> bool:
        """Whether the state after `step` steps is a commit point: one every member can be
        rebuilt from (restored, or healed from a peer), where replacements are let in.
        Default: every step (replicas that agree after each step, as ddp's)."""
        return True

    def will_save(self, step: int) -> None:
        """Told before `step` (0-based) is trained when the trainer saves a snapshot after it,
        on the members' rank 0 alone (`Strategy.state_dict`). A strategy whose state is spread
        over the members gathers it there inside that step, where a fault is recovered.
        Default: nothing (each member holds all of it)."""
        return None

    @abstractmethod
    def on_members(self, runtime: Runtime) -> None:
        """A new generation: `runtime` says this member's rank, the members' number and their
        process group (outside torch's registry: call its methods, or dist ops without src)."""

    def contribution(self) -> Any:
        """What this member's last `train_step` computed before the step's collective (its
        summands, e.g. gradients weighted by its share), kept through a failed collective; None
        (the default): after a fault the step is trained again whole. The caller hands it back
        as `held` when the same step is redone, and trains only the samples nobody holds
        (`ringtrain.live.GlobalBatches.redo_shares`): a stall then redoes a lost member's share,
        not the whole step."""
        return None

    @abstractmethod
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float,
                   held: Any = None) -> StepResult:
        """This member's share of one step (`weight`: its samples / the global batch's), added
        to `held` (this member's `contribution()` of the same step, from before a fault; given
        only by hooks that make one); raise the collective's RuntimeError if a peer is lost
        (the caller recovers and redoes it)."""


class Strategy(ABC):
    """One rank's view of a distributed model. Call every method on every rank, same order."""

    name: str = ""
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig  # its options and pre-launch checks
    # True when every rank holds the whole model and optimizer state (DDP): a snapshot is then
    # written once and can be resumed on any number of ranks. False: per-rank parts, same layout.
    replicated_state: bool = False
    tracer: Tracer = NO_TRACE  # spans of its steps (`ringtrain.trace`), set by `trace`

    # -- the seam ------------------------------------------------------------------------------
    @abstractmethod
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        """Take the plain model (identically initialised on every rank) and build the optimizer."""

    @property
    @abstractmethod
    def data_rank(self) -> int | None:
        """Which data shard this rank reads (sampler rank); None when it reads no data."""

    def seed_rank(self, rank: int) -> int:
        """The rank whose random stream (dropout) `rank` draws, seeded from (seed, it): its
        own; tensor parallelism's ranks of one replica share one."""
        return rank

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
    def updated_state(self) -> UpdatedState | None:
        """The state only the optimizer step changes (see `UpdatedState`), so a background
        snapshot may copy it beside the next step. Default None: every tensor of `state_dict()`
        is copied in the snapshot's step (right for any strategy, only slower)."""
        return None

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
    def tolerated_ranks(self) -> frozenset[int]:
        """Ranks whose death this job survives; `rank_departed` is told when one dies."""
        return frozenset()

    def rank_departed(self, rank: int, why: str) -> None:
        """A tolerated rank died (the watchdog found it): go on without it."""
        return None

    def live_hooks(self) -> LiveHooks | None:
        """What live recovery (`ringtrain train --live`) needs of this strategy after `setup`
        (`ringtrain.strategies.live_step`); None (the default): it has none, and its
        `Config.live_refusal` says so before launch."""
        return None

    def trace(self, tracer: Tracer) -> None:
        """Record forward, backward, optimizer and communication spans into `tracer` (called
        before `setup`, which hands it to the engines)."""
        self.tracer = tracer

    def stats(self) -> dict[str, Any]:
        """The strategy's own figures for the run's summary (after `model_state_dict`)."""
        return {}

    def reshard_sources(self, saved_world_size: int) -> list[int] | None:
        """Resuming per-rank state saved by another number of ranks: every saved rank whose
        part this rank reads (`load_resharded_state_dict` gets them); None (the default): the
        state cannot be resharded (refused, naming both world sizes). Replicated state
        (`replicated_state`) needs no answer."""
        return None

    def load_resharded_state_dict(self, parts: dict[int, dict[str, Any]]) -> None:
        """Load per-rank state saved by another number of ranks: `parts` maps each saved rank of
        `reshard_sources` to its `state_dict()`. Default: `load_state_dict` of the one part."""
        (state,) = parts.values()
        self.load_state_dict(state)

    def state_layout(self) -> dict[str, Any]:
        """What, besides the strategy and the world size, must equal the saved run's for this
        rank's state to load as it was saved (a pipeline's pp); a snapshot of another layout or
        strategy resumes through the layout-free form (`to_portable`). Default: nothing."""
        return {}

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """This strategy's snapshot in the layout-free form (`ringtrain.strategies.portable`),
        for a resume by another strategy or layout; no process group (any rank calls it).

        Args:
            read_parts: saved ranks -> their `state_dict()` (read from their `rank{r}.pt`).
            shared: the `state_dict()` rank 0 saved for every rank (`replicated_state`), else
                None.
            metadata: the snapshot's (its `world_size`, its `topology` with `state_layout`).

        None (the default): this strategy's snapshots resume in its own layout only.
        """
        return None

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        """Load the layout-free form (`to_portable` of any strategy) into this rank's part; every
        rank calls it (it may be collective). ValueError: this model or layout cannot take it
        (the reason). NotImplementedError (the default): this strategy loads its own snapshots
        only; the resume then names the snapshot's --strategy and world size."""
        raise NotImplementedError(f"--strategy {self.name} has no load_portable_state_dict")

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
