"""Data parallelism: every rank holds the whole model, gradients are averaged by all-reduce.

    ringtrain train --nproc-per-node 2 --strategy ddp

The model is wrapped in `ringtrain.DistributedDataParallel`; gradient accumulation runs every
micro-batch but the last under `no_sync()`, so there is one all-reduce per optimizer step.
`--grad-compress fp16|bf16|powersgd:R` registers a comm hook (`ringtrain.ddp.comm_hooks`,
`ringtrain.ddp.powersgd`): fewer bytes per step on a slow link, at some cost in accuracy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.config import option
from ringtrain.ddp.comm_hooks import bf16_compress_hook, fp16_compress_hook
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.powersgd import PowerSGDState, powersgd_hook
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
from ringtrain.strategies.figures import Figures, Workload, all_reduce_share
from ringtrain.strategies.live_step import ReplicaLiveHooks
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.types import LossFn, OptimizerFn


def parse_grad_compress(text: str) -> str:
    """An argparse type: none, fp16, bf16 or powersgd:R (R a positive integer)."""
    kind, _, r = text.partition(":")
    if kind in ("none", "fp16", "bf16") and not r:
        return text
    if kind == "powersgd" and r.isdigit() and int(r) >= 1:
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: use none, fp16, bf16 or powersgd:R with R >= 1 "
                                     "(e.g. powersgd:4)")


def _strip_module_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Accept a wrapper's state_dict (`module.` keys) as well as the plain module's."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


@dataclass(frozen=True, kw_only=True)
class DDPFigures(Figures):
    """`--strategy ddp`'s figures: what its all-reduce carries."""

    wire: str  # the gradients' dtype on the wire (fp32, fp16, bf16) or "powersgd"
    buffer_bytes: int | None  # the gradients all-reduced per step; None: PowerSGD's factors
    ring_share: float  # 2(N-1)/N: bytes a rank sends per byte of the buffer
    dense_sent_bytes: float  # what the fp32 gradients would cost: for comparison


@dataclass(frozen=True, kw_only=True)
class DDPConfig(StrategyConfig):
    """`--strategy ddp`'s options."""

    grad_compress: str = option("none", "gradient compression: none, fp16, bf16 or powersgd:R",
                                type=parse_grad_compress)

    def live_refusal(self) -> str | None:
        if self.grad_compress == "none":
            return None
        return (f"--grad-compress {self.grad_compress} is a hook on DDP's wrapper, which the live "
                "step does not use (its gradients are summed over each generation's group in "
                "full precision): drop --grad-compress, or drop --live")

    def figures(self, workload: Workload) -> DDPFigures:
        """A replica per rank; one ring all-reduce of the gradients per optimizer step (the
        micro-batches before the last run under no_sync), at 2 bytes a gradient under fp16 or
        bf16. PowerSGD's factors depend on the matrices' shapes: counted during the run."""
        n, model = workload.world_size, workload.model_bytes
        kind = self.grad_compress.partition(":")[0]
        wire = "fp32" if kind == "none" else kind
        buffer = {"fp32": model, "fp16": model // 2, "bf16": model // 2}.get(wire)
        share = all_reduce_share(n)
        sent = 0.0 if n == 1 else None if buffer is None else share * buffer
        return DDPFigures(data_ranks=n, **workload.replica(), sent_bytes=sent, wire=wire,
                          buffer_bytes=buffer, ring_share=share,
                          dense_sent_bytes=share * model)


class DDPStrategy(ShardPerRank, Strategy):
    """One full replica per rank, averaged gradients (`DistributedDataParallel`).

    Args:
        runtime: this process's `Runtime` (rank, world_size, device, process_group).
        bucket_cap_mb: DDP's gradient bucket size.
        find_unused_parameters: DDP's handling of parameters that get no gradient.
        grad_compress: "none", "fp16", "bf16" or "powersgd:R" (--grad-compress).
    """

    name = "ddp"
    replicated_state = True
    Config = DDPConfig

    def __init__(self, runtime: Runtime, *, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, grad_compress: str = "none"):
        try:
            parse_grad_compress(grad_compress)
        except argparse.ArgumentTypeError as e:  # from a script: the same words, as a ConfigError
            raise ConfigError(f"--grad-compress {e}") from None
        self.runtime, self.compress = runtime, grad_compress
        self.powersgd: PowerSGDState | None = None
        # PowerSGD's error feedback differs per rank: each rank saves its own part.
        self.replicated_state = not grad_compress.startswith("powersgd")
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.module: nn.Module | None = None
        self._hooks: list[Any] = []
        self._last_grad_at = 0.0

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        device = self.runtime.device
        self.module = model.to(device)
        self.optimizer = optimizer_fn(self.module.parameters())
        self.loss_fn = loss_fn
        # One rank has no one to average with: the step runs the plain module. The wrapper
        # would copy every gradient into its buckets and back and divide by 1 (the same values:
        # 3 ms of a 66 ms step of nanoGPT's CPU GPT, benchmarks/gpu_gpt.py). A compression hook
        # changes the gradients even alone, so it keeps the wrapper.
        self.ddp: nn.Module = self.module
        self._no_sync = None
        if self.runtime.world_size == 1 and self.compress == "none":
            return
        self.ddp = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.runtime.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            tracer=self.tracer,
        )
        self._no_sync = self.ddp.no_sync
        if self.compress in ("fp16", "bf16"):
            hook = fp16_compress_hook if self.compress == "fp16" else bf16_compress_hook
            self.ddp.register_comm_hook(self.runtime.process_group, hook)
        elif self.compress.startswith("powersgd:"):
            self.powersgd = PowerSGDState(self.runtime.process_group,
                                          rank=int(self.compress.split(":")[1]))
            self.ddp.register_comm_hook(self.powersgd, powersgd_hook)
        # The communication wait is the time between the last local gradient being ready and
        # backward() returning with averaged gradients: DDP overlaps bucket all-reduces with the
        # rest of backward, so only what is left after the last gradient is exposed waiting.
        # These hooks run after DDP's own (registered first) and only take a timestamp.
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark_grad)
                       for p in self.module.parameters() if p.requires_grad]

    def _mark_grad(self, _param: torch.Tensor) -> None:
        self._last_grad_at = time.perf_counter()

    def _parameters(self) -> Iterable[nn.Parameter]:
        assert self.module is not None, "setup() first"
        return self.module.parameters()

    # -- the seam -------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        if not micro_batches:
            raise ValueError(f"rank {self.runtime.rank}: train_step got no micro-batches; "
                             "every DDP rank must take part in every step")
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        acc = accumulate(micro_batches, self.ddp, self.loss_fn, device=self.runtime.device,
                         tracer=self.tracer, no_sync=self._no_sync)
        comm_s = 0.0
        if self.runtime.world_size > 1:  # one rank: no communication, all compute
            comm_s = max(0.0, time.perf_counter() - self._last_grad_at)
        # Gradients are identical on every rank after the all-reduce, so is the clip factor.
        optimizer_step(self.optimizer, self.tracer, grad_clip=grad_clip,
                       clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(self._parameters(),
                                                                            max_norm))
        elapsed = time.perf_counter() - start
        return StepResult(loss_sum=acc.loss_sum, count=acc.count, compute_s=elapsed - comm_s,
                          comm_s=comm_s)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        assert self.module is not None, "setup() first"
        return eval_forward(self.module, x, self.runtime.device)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None, "setup() first"
        return self.module.state_dict()

    def live_hooks(self) -> ReplicaLiveHooks:
        """A whole replica per member, gradients summed over each generation's group
        (built with a one-rank runtime: `setup` then wraps nothing)."""
        assert self.module is not None, "setup() first"
        return ReplicaLiveHooks(self)

    def _optimizer_names(self) -> list[str]:
        assert self.module is not None, "setup() first"
        return portable.optimizer_param_names(self.optimizer, portable.param_names(self.module))

    def state_dict(self) -> dict[str, Any]:
        assert self.module is not None, "setup() first"
        # The names make it convertible to the layout-free form (`to_portable`).
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "param_names": self._optimizer_names()}
        if self.powersgd is not None:
            state["powersgd"] = self.powersgd.state_dict(list(self.module.parameters()))
        return state

    def updated_state(self) -> UpdatedState:
        # Parameters and the optimizer's moments change only in optimizer.step(). Left out,
        # so copied in the snapshot's step: buffers (the wrapper broadcasts them in each
        # forward) and PowerSGD's error feedback (changed in the backward).
        moments = [t for per_param in self.optimizer.state.values()
                   for t in per_param.values() if isinstance(t, torch.Tensor)]
        return UpdatedState([*self._parameters(), *moments], [self.optimizer])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        self.module.load_state_dict(_strip_module_prefix(state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.powersgd is not None and "powersgd" in state:
            self.powersgd.load_state_dict(state["powersgd"], list(self.module.parameters()))

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0's replica (PowerSGD's error feedback, per rank, is left behind: it is a
        correction of the last steps' compression, and starts again at zero)."""
        state = shared if shared is not None else read_parts([0])[0]
        if "param_names" not in state:
            raise ConfigError("this ddp snapshot was written by a ringtrain that did not name "
                              "the optimizer's parameters: resume it with --strategy ddp")
        return portable.make(_strip_module_prefix(state["model"]),
                             portable.optimizer_by_name(state["optimizer"], state["param_names"]))

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        portable.check(state)
        portable.load_model(self.module, state["model"])
        portable.load_optimizer(self.optimizer, self._optimizer_names(), state["optimizer"])

    def reshard_sources(self, saved_world_size: int) -> list[int] | None:
        """PowerSGD on another number of ranks: the weights are the same on every rank, the
        error feedback is taken from saved rank r modulo the saved world size."""
        return [self.runtime.rank % saved_world_size]

    def stats(self) -> dict[str, Any]:
        if self.powersgd is None:
            return {}
        return {"grad_compress": self.compress, "powersgd_bytes_sent": self.powersgd.bytes_sent}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
