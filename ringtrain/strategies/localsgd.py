"""`--strategy localsgd`: every worker trains alone for H steps, then the weights are averaged.

    ringtrain train --strategy localsgd --sync-every 10 --nproc-per-node 2

Each rank holds a full replica and its own optimizer and reads its own data shard, like DDP,
but no gradient is all-reduced: after every `--sync-every` H optimizer steps the ranks meet
once and average their parameters (`ringtrain.localsgd.outer.average_weights`), so a slow link
carries one model per H steps instead of one gradient per step. With H = 1 and plain SGD this
is DDP with SGD (the mean of the updated weights is the update with the mean gradient).
Evaluation and `model_state_dict()` use the weights of the last meeting, the same on every
rank; `model_state_dict()` first meets once more if steps were taken since (every rank calls
it at the same point, at the end). A stop signal (SIGTERM) is voted on at metric steps only:
a per-step vote would cost a round trip on the slow link every step. `ringtrain.strategies.
diloco` adds DiLoCo's outer optimizer on top of this.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.agreement.base import Agreement, CollectiveAgreement
from ringtrain.config import int_at_least, option
from ringtrain.errors import ConfigError
from ringtrain.localsgd.outer import average_weights
from ringtrain.runtime import Runtime
from ringtrain.strategies import portable
from ringtrain.strategies.base import (
    ShardPerRank,
    StepResult,
    Strategy,
    StrategyConfig,
    eval_forward,
)
from ringtrain.strategies.figures import FP32_BYTES, Figures, Workload, all_reduce_share
from ringtrain.strategies.localsgd_live import RoundLiveHooks
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.types import LossFn, OptimizerFn


@dataclass(frozen=True, kw_only=True)
class LocalSGDFigures(Figures):
    """`--strategy localsgd`'s (and diloco's) figures: one meeting per `sync_every` steps."""

    sync_every: int
    meeting_bytes: float  # a rank sends per meeting; `sent_bytes` is it over sync_every
    ddp_sent_bytes: float  # what DDP's all-reduce of the fp32 gradients sends every step


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig(StrategyConfig):
    """`--strategy localsgd`'s options (DiLoCo's extend them)."""

    sync_every: int = option(50, "optimizer steps between the workers' meetings, H",
                             type=int_at_least(1))

    def live_refusal(self) -> str | None:
        return None  # `RoundLiveHooks`: the meetings are the commit points

    def meeting_bytes(self, params: int, world_size: int) -> float:
        """Bytes a rank sends per meeting: a ring all-reduce of the fp32 parameters, 2(N-1)/N."""
        return all_reduce_share(world_size) * params * FP32_BYTES

    def figures(self, workload: Workload) -> LocalSGDFigures:
        """A replica, its optimizer and the weights of the last meeting (a second copy of the
        parameters, for evaluation) per rank; nothing sent between meetings."""
        n, replica = workload.world_size, workload.replica()
        meeting = self.meeting_bytes(workload.params, n)
        return LocalSGDFigures(
            data_ranks=n, params_bytes=2 * replica["params_bytes"],
            grads_bytes=replica["grads_bytes"], optimizer_bytes=replica["optimizer_bytes"],
            sent_bytes=meeting / self.sync_every, sync_every=self.sync_every,
            meeting_bytes=meeting, ddp_sent_bytes=all_reduce_share(n) * workload.model_bytes)


class LocalSGDStrategy(ShardPerRank, Strategy):
    """One replica per rank, trained alone for `sync_every` steps between meetings.

    Args:
        runtime: this process's `Runtime`.
        sync_every: optimizer steps between meetings (H, --sync-every).
    """

    name = "localsgd"
    Config = LocalSGDConfig

    def __init__(self, runtime: Runtime, sync_every: int = 50):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigError(f"--sync-every {sync_every!r}: it must be a positive number of steps")
        self.runtime, self.sync_every = runtime, sync_every
        self.replicated_state = False  # optimizer states differ per rank; see reshard_sources
        self.module: nn.Module | None = None
        self.inner_steps = 0  # optimizer steps taken; a meeting after every sync_every-th
        self.meetings, self.bytes_sent, self.meeting_s = 0, 0, 0.0

    # -- set-up -----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        self.module = model.to(self.runtime.device)
        self.optimizer = optimizer_fn(self.module.parameters())
        self.loss_fn = loss_fn
        self.synced = copy.deepcopy(self.module)  # the weights of the last meeting (evaluation)
        self.synced.requires_grad_(False)

    def _params(self) -> list[torch.Tensor]:
        assert self.module is not None, "setup() first"
        return [p for p in self.module.parameters() if p.requires_grad]

    def _meet(self) -> None:
        """Every rank, at the same inner step: agree on one model (here: the mean)."""
        self.bytes_sent += average_weights(self._params(), self.runtime.process_group,
                                           self.runtime.world_size)

    def _met(self) -> None:
        self.meetings += 1
        self._copy_to_synced()

    def _copy_to_synced(self) -> None:
        with torch.no_grad():
            for s, p in zip(self.synced.parameters(), self.module.parameters(), strict=True):
                s.copy_(p)

    # -- the seam ---------------------------------------------------------------------------------
    def agreement(self, runtime: Runtime, name: str) -> Agreement:
        return CollectiveAgreement(runtime.process_group, runtime.world_size, vote_every_step=False)

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        assert self.module is not None, "setup() first"
        if not micro_batches:
            raise ValueError(f"rank {self.runtime.rank}: train_step got no micro-batches; every "
                             f"{self.name} rank trains on its own shard")
        return self.inner_step(micro_batches, lr=lr, grad_clip=grad_clip)

    def inner_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None) -> StepResult:
        """One inner step on this rank's micro-batches and, after every `sync_every`-th, the
        meeting. No micro-batches (a live member whose share of the step is empty): no
        optimizer step, but the step counts and the meeting is kept with the others."""
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        if micro_batches:
            acc = accumulate(micro_batches, self.module, self.loss_fn,
                             device=self.runtime.device, tracer=self.tracer)
            loss_sum, count = acc.loss_sum, acc.count
            optimizer_step(self.optimizer, self.tracer, grad_clip=grad_clip,  # its own norm
                           clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(self._params(),
                                                                                max_norm))
        self.inner_steps += 1
        comm_s = 0.0
        if self.inner_steps % self.sync_every == 0:
            t0 = time.perf_counter()
            with self.tracer.span("meeting (average the replicas)", "comm"):
                self._meet()
                self._met()
            # One rank has no one to meet: its averaging is a copy, not communication.
            comm_s = time.perf_counter() - t0 if self.runtime.world_size > 1 else 0.0
            self.meeting_s += comm_s
        elapsed = time.perf_counter() - start
        return StepResult(loss_sum=loss_sum, count=count, compute_s=elapsed - comm_s,
                          comm_s=comm_s)

    def live_hooks(self) -> RoundLiveHooks:
        """A replica per member that meets every `sync_every` steps: the meetings are the
        commit points (`ringtrain.strategies.localsgd_live`)."""
        assert self.module is not None, "setup() first"
        return RoundLiveHooks(self, self.sync_every)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        return eval_forward(self.synced, x, self.runtime.device)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The agreed model: a last meeting first if steps were taken since the previous one."""
        assert self.module is not None, "setup() first"
        if self.inner_steps % self.sync_every:
            self._meet()
            self._met()
        return self.synced.state_dict()

    def stats(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "meetings": self.meetings,
                "meeting_bytes_sent": self.bytes_sent,
                "meeting_s_mean": self.meeting_s / self.meetings if self.meetings else None}

    # -- snapshots --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's replica and optimizer, the last meeting's weights and the step count."""
        assert self.module is not None, "setup() first"
        # The names make it convertible to the layout-free form (`to_portable`).
        return {"model": self.module.state_dict(), **self.round_state_dict(),
                "world_size": self.runtime.world_size, "param_names": self._optimizer_names()}

    def _optimizer_names(self) -> list[str]:
        assert self.module is not None, "setup() first"
        return portable.optimizer_param_names(self.optimizer, portable.param_names(self.module))

    def round_state_dict(self) -> dict[str, Any]:
        """What this rank holds besides its replica's weights: its inner optimizer, the weights
        of the last meeting, the step count (so the place in the period) and the figures."""
        return {"optimizer": self.optimizer.state_dict(), "synced": self.synced.state_dict(),
                "inner_steps": self.inner_steps, "sync_every": self.sync_every,
                "meetings": self.meetings, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        steps, saved_ws = int(state["inner_steps"]), int(state["world_size"])
        if saved_ws != self.runtime.world_size and steps % self.sync_every:
            raise ConfigError(
                f"the snapshot (step {steps}) was written between two meetings of "
                f"{saved_ws} workers (--sync-every {self.sync_every}); another number of workers "
                f"can only resume at a meeting. Resume on {saved_ws} workers, or from a snapshot "
                f"at a multiple of --sync-every (use --snapshot-every {self.sync_every} or a "
                "multiple of it)")
        self.module.load_state_dict(state["model"])
        self.load_round_state_dict(state)

    def load_round_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `round_state_dict` (a live member's restore or heal: no world-size check,
        its commits are at meetings)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.synced.load_state_dict(state["synced"])
        self.inner_steps = int(state["inner_steps"])
        self.meetings, self.bytes_sent = int(state["meetings"]), int(state["bytes_sent"])

    def reshard_sources(self, saved_world_size: int) -> list[int] | None:
        """At a meeting every replica holds the same weights: rank r takes saved rank r's part
        (its optimizer state) modulo the saved world size. `load_state_dict` refuses a snapshot
        taken between meetings."""
        return [self.runtime.rank % saved_world_size]

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The replicas at a meeting, where their weights are one model: that model, and each
        parameter's AdamW moments averaged over the replicas (`portable.mean`). Each replica
        stepped its own moments on its own gradients: the mean of the first moments is the
        moving average of the mean gradient, the one a ddp run keeps; the mean of the second
        moments, a mean of squares, is not below the square of the mean. DiLoCo's outer
        momentum has no place in the form and starts again at zero in the target. A snapshot
        between two meetings holds replicas that differ: refused, naming the fix."""
        saved_ws = int(metadata["world_size"])
        first = read_parts([0])[0]
        steps, every = int(first["inner_steps"]), int(first["sync_every"])
        fix = (f"Resume with --strategy {cls.name} on world_size={saved_ws}, or from a "
               f"snapshot at a meeting (--snapshot-every {every} or a multiple of it)")
        if "param_names" not in first:
            raise ConfigError(f"this {cls.name} snapshot was written by a ringtrain that did not "
                              f"name the optimizer's parameters. {fix}")
        if steps % every:
            raise ConfigError(
                f"the {cls.name} snapshot (step {steps}) was written between two meetings "
                f"(--sync-every {every}): its {saved_ws} replicas differ, so it is no one model "
                f"another strategy or layout could take on. {fix}")

        def by_name(part: dict[str, Any]) -> dict[str, Any]:
            return portable.optimizer_by_name(part["optimizer"], part["param_names"])

        # One rank's file at a time: W replicas' states together would not fit a large model.
        return portable.make(first["model"], portable.mean(
            by_name(first if r == 0 else read_parts([r])[r]) for r in range(saved_ws)))

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        """Every replica takes the same model and optimizer state, as at a meeting. The step
        count is the snapshot's (`state["step"]`, the loop's), so the meetings keep their places
        in the run: every --sync-every-th step."""
        assert self.module is not None, "setup() first"
        portable.check(state)
        portable.load_model(self.module, state["model"])
        portable.load_optimizer(self.optimizer, self._optimizer_names(), state["optimizer"])
        self._copy_to_synced()
        self.inner_steps = portable.step_of(state)
