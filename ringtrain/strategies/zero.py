"""Sharded data parallelism (ZeRO): optimizer state, gradients and (stage 3) parameters split.

    ringtrain train --nproc-per-node 2 --strategy zero --zero-stage 2

Every rank reads its own data shard, as with `ddp`; `ringtrain.zero.ZeroDataParallel` keeps
1/N of the AdamW moments (stage 1), of the gradients (2) and of the parameters (3) on each rank.
Gradient accumulation runs every micro-batch but the last under `no_sync()`. State is per rank
(each rank's shard, in a flat layout that resumes on any number of ranks: a snapshot of 2
ranks resumes on 3); `model_state_dict()` gathers the full model on every rank. With `--live`
the step is `zero_live.ZeroLiveHooks`'s: the wrapper is built again over each generation of
members, and each shard (stage 3: its parameters too) is copied to a buddy after every step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.runtime import Runtime
from ringtrain.strategies import portable
from ringtrain.strategies.base import (
    ShardPerRank,
    StepResult,
    Strategy,
    StrategyConfig,
    UpdatedState,
    eval_forward,
)
from ringtrain.strategies.figures import Figures, Workload, gather_share
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.strategies.tp_options import zero_stage_option
from ringtrain.strategies.zero_live import ZeroLiveHooks
from ringtrain.types import LossFn, OptimizerFn
from ringtrain.zero import reshard
from ringtrain.zero import state as zero_state
from ringtrain.zero.shard import STAGES, expected_bytes
from ringtrain.zero.sharded import ZeroDataParallel


@dataclass(frozen=True, kw_only=True)
class ZeroFigures(Figures):
    """`--strategy zero`'s figures: its collectives, and a DDP replica's bytes to compare."""

    stage: int
    collectives: int  # reduce-scatters and all-gathers of the whole model per optimizer step
    gather_share: float  # (N-1)/N: bytes a rank sends per byte of the model, per collective
    model_bytes: float  # the whole model in fp32: what each collective carries
    replica_bytes: float  # what a DDP rank holds (fp32 AdamW, 16 bytes per parameter)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(StrategyConfig):
    """`--strategy zero`'s options."""

    zero_stage: int = zero_stage_option(2, STAGES)

    def live_refusal(self) -> str | None:
        # Every stage: `ZeroLiveHooks` copies each shard (stage 3: parameters too) to a buddy
        # and re-shards the last commit over each new generation.
        return None

    def figures(self, workload: Workload) -> ZeroFigures:
        """1/N of what is sharded (`expected_bytes`, the paper's count). Per step, stages 1 and
        2: a reduce-scatter of the gradients and an all-gather of the updated parameters (as
        many bytes as DDP's all-reduce); stage 3: the parameters are all-gathered before each
        micro-batch's forward and again before its backward, and the gradients reduce-scattered
        once (the micro-batches before the last accumulate under no_sync)."""
        n, stage = workload.world_size, int(self.zero_stage)
        held = expected_bytes(workload.params, n, stage)
        collectives = 2 * workload.grad_accum + 1 if stage == 3 else 2
        share = gather_share(n)
        return ZeroFigures(data_ranks=n, params_bytes=held["params"], grads_bytes=held["grads"],
                           optimizer_bytes=held["optimizer"],
                           sent_bytes=collectives * share * workload.model_bytes, stage=stage,
                           collectives=collectives, gather_share=share,
                           model_bytes=workload.model_bytes,
                           replica_bytes=sum(workload.replica().values()))


class ZeroStrategy(ShardPerRank, Strategy):
    """ZeRO data parallelism over every rank.

    Args:
        runtime: this process's `Runtime` (rank, world_size, device, process_group).
        zero_stage: 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters).
    """

    name = "zero"
    replicated_state = False  # each rank saves its own shard
    Config = ZeroConfig

    def __init__(self, runtime: Runtime, *, zero_stage: int | str = 2):
        try:
            stage = int(zero_stage)
        except (TypeError, ValueError):
            stage = -1
        if stage not in STAGES:
            raise ConfigError(f"--zero-stage {zero_stage!r}: choose 1 (optimizer state sharded), "
                              "2 (+ gradients) or 3 (+ parameters)")
        self.runtime, self.zero_stage = runtime, stage
        self.model: ZeroDataParallel | None = None
        self._memory: dict[str, Any] = {}
        self._live: ZeroLiveHooks | None = None

    @staticmethod
    def bytes_per_rank(numel: int, world_size: int, stage: int) -> dict[str, float]:
        """Parameter, gradient and optimizer bytes a rank holds at `stage` (fp32 AdamW), for
        `ringtrain plan`; the working set of stage 3 is not included."""
        return expected_bytes(numel, world_size, stage)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        self.module, self._optimizer_fn = model.to(self.runtime.device), optimizer_fn
        self.loss_fn = loss_fn
        if self.runtime.process_group is None:  # --live: one replica until the first generation
            self._build(ZeroDataParallel, _one_rank_group())
        else:
            self._build(ZeroDataParallel, self.runtime.process_group)

    def _build(self, wrapper: type[ZeroDataParallel], group: Any, **kwargs: Any) -> None:
        self.model = wrapper(self.module, self._optimizer_fn, stage=self.zero_stage,
                             process_group=group, **kwargs)
        self.model.trace(self.tracer)
        self.optimizer = self.model.optimizer

    def rebuild(self, group: Any) -> None:
        """--live: the wrapper built again over a new generation's `group` (its units' layout
        depends on the number of members); the caller loads the optimizer state into it."""
        self._zero().remove_hooks()
        # One lane: lanes are extra groups made through torch's registry, which a generation's
        # group (built on the store, `ringtrain.live.group`) is not in.
        self._build(_MembersZero, group, comm_lanes=1)

    def _zero(self) -> ZeroDataParallel:
        assert self.model is not None, "setup() first"
        return self.model

    def _gathering(self) -> ZeroDataParallel:
        """The wrapper, for a use that gathers the parameters through it (stage 3); under
        --live first re-sharded over members that changed since the last step trained (healed
        to a step a peer had committed, or lost after the last step: `ZeroLiveHooks.settle`)."""
        if self._live is not None and self.zero_stage == 3:
            self._live.settle()
        return self._zero()

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        model = self._zero()
        if not micro_batches:
            raise ValueError(f"rank {self.runtime.rank}: train_step got no micro-batches; every "
                             "ZeRO rank must take part in every step")
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        acc = accumulate(micro_batches, model, self.loss_fn, device=self.runtime.device,
                         tracer=self.tracer, no_sync=model.no_sync)
        optimizer_step(self.optimizer, self.tracer, grad_clip=grad_clip, clip=model.clip_grad_norm_)
        self._memory = model.memory()  # what a rank holds between steps (counted, cheap)
        return StepResult(loss_sum=acc.loss_sum, count=acc.count,
                          compute_s=time.perf_counter() - start)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        # The wrapper, not the plain module: stage 3 gathers each unit as it runs.
        return eval_forward(self._gathering(), x, self.runtime.device)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        # The end of a run: the trainer may use the plain module afterwards (rank 0 samples from
        # it), so stage 3 leaves it gathered; `stats()` reports the bytes of the last step.
        return self._gathering().full_state_dict(keep_gathered=True)

    def state_dict(self) -> dict[str, Any]:
        if self._live is not None:  # the members' rank 0 saves alone: the whole state
            return {"zero": self._live.snapshot_state()}
        return {"zero": self._zero().shard_state_dict()}

    def updated_state(self) -> UpdatedState | None:
        # What `state_dict()` returns as is, which only the optimizer step changes in place: the
        # flat moment buffers (the optimizer's state is views into them once a state_dict was
        # taken) and stage 3's shard (its own storage). Stages 1/2's shard is a view of `full`,
        # which the next forward's all-gather writes: `state_dict()` clones it in the step.
        if self._live is not None:
            # Live: `state_dict()` is the members' snapshot, gathered to rank 0 as fresh copies
            # that no step touches; the optimizer's buffers are not what it returns.
            return None
        zero = self._zero()
        moments = [flat for per_key in zero_state.flat_moments(zero.units, zero.optimizer)
                   for flat in per_key.values()]
        shards = [u.shard for u in zero.units] if zero.stage == 3 else []
        return UpdatedState([*shards, *moments], [zero.optimizer.optimizer])

    def live_hooks(self) -> ZeroLiveHooks:
        """Each shard copied to a buddy after every step, re-sharded over each generation
        (built with a one-rank runtime: `setup` then wraps over a group of one)."""
        assert self.model is not None, "setup() first"
        if self._live is None:
            # The launcher's word for members per host: a buddy on another host where it can.
            self._live = ZeroLiveHooks(self, local_world_size=int(
                os.environ.get("LOCAL_WORLD_SIZE") or 1))
        return self._live

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._zero().load_shard_state_dict(state["zero"])

    def reshard_sources(self, saved_world_size: int) -> list[int] | None:
        """The saved ranks whose shards overlap this rank's new ones (a snapshot of N ranks
        resumes on M: each rank re-slices the flat units, `ringtrain.zero.reshard`)."""
        numels = [u.plan.numel for u in self._zero().units]
        # A rank holding only padding still reads one part (its optimizer's settings).
        return reshard.sources(numels, saved_world_size, self.runtime.world_size,
                               self.runtime.rank) or [0]

    def load_resharded_state_dict(self, parts: dict[int, dict[str, Any]]) -> None:
        self._zero().load_shard_state_dicts({r: p["zero"] for r, p in parts.items()})

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """Every saved rank's shards put together (`reshard.consolidate`), cut by parameter."""
        parts = read_parts(list(range(int(metadata["world_size"]))))
        try:
            model, state = zero_state.to_named([p["zero"] for _, p in sorted(parts.items())])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return portable.make(model, {"state": state})

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        portable.check(state)
        self._zero().load_named_state(state["model"], state["optimizer"]["state"])

    def stats(self) -> dict[str, Any]:
        memory = self._memory or self._zero().memory()
        out = {"zero_stage": self.zero_stage, **{f"zero_{k}": v for k, v in memory.items()}}
        if self._live is not None:  # --live: what the copy of each shard to a buddy cost
            out.update(self._live.figures())
        return out

    def close(self) -> None:
        if self.model is not None:
            self.model.remove_hooks()


class _MembersZero(ZeroDataParallel):
    """The wrapper over a live generation's group: no broadcast of rank 0's weights at
    construction (the members' models are equal already, healed; and the broadcast names its
    source by global rank, which a group outside torch's registry does not have)."""

    def _broadcast_from_rank0(self, module: nn.Module) -> None:
        return None


def _one_rank_group() -> dist.ProcessGroup:
    """A gloo group of this process alone (no default group in a live job): the wrapper of
    one replica before the first generation, whose collectives are then no-ops."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
