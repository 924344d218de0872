"""`--strategy diloco`: local SGD whose meetings apply an outer optimizer (DiLoCo).

    ringtrain train --strategy diloco --sync-every 50 --nproc-per-node 2
    ringtrain train --strategy diloco --sync-every 50 --outer-compress int8 ...

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models":
each worker takes H inner steps with its own AdamW (the trainer's optimizer), then the workers
all-reduce the pseudo-gradient (the weights at the last outer step minus their weights now) and
an outer SGD with Nesterov momentum (lr 0.7, momentum 0.9: the paper's values) moves the shared
weights (`ringtrain.localsgd.outer.OuterStep`). The pseudo-gradient may travel in bf16 or int8
with a per-tensor scale (`--outer-compress`). With `--outer-lr 1 --outer-momentum 0` it is
local SGD. Everything else (data, evaluation, snapshots, stop votes) is local SGD's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ringtrain.config import non_negative_float, option
from ringtrain.errors import ConfigError
from ringtrain.localsgd.compress import CODECS
from ringtrain.localsgd.outer import OuterStep
from ringtrain.runtime import Runtime
from ringtrain.strategies.figures import FP32_BYTES, Workload
from ringtrain.strategies.localsgd import LocalSGDConfig, LocalSGDFigures, LocalSGDStrategy
from ringtrain.types import LossFn, OptimizerFn


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(LocalSGDConfig):
    """`--strategy diloco`'s options: local SGD's (--sync-every) and the outer step's."""

    outer_lr: float = option(0.7, "DiLoCo's outer learning rate", type=non_negative_float)
    outer_momentum: float = option(0.9, "DiLoCo's outer Nesterov momentum, 0 for none",
                                   type=non_negative_float)
    outer_compress: str = option("fp32", "how the pseudo-gradient travels", choices=CODECS)

    def meeting_bytes(self, params: int, world_size: int) -> float:
        """fp32: a ring all-reduce; bf16 and int8: an all-gather of every rank's pseudo-gradient
        at 2 or 1 bytes a parameter (int8's one scale per tensor left out)."""
        if self.outer_compress == "fp32":
            return super().meeting_bytes(params, world_size)
        return params * (2 if self.outer_compress == "bf16" else 1) * (world_size - 1)

    def figures(self, workload: Workload) -> LocalSGDFigures:
        """Local SGD's, plus the outer optimizer's state: the anchor (the weights of the last
        outer step) and, with momentum, its buffer, fp32 each."""
        outer = workload.params * FP32_BYTES * (2 if self.outer_momentum else 1)
        local = super().figures(workload)
        return replace(local, optimizer_bytes=local.optimizer_bytes + outer)


class DiLoCoStrategy(LocalSGDStrategy):
    """Local SGD with DiLoCo's outer optimizer on the pseudo-gradient.

    Args:
        runtime: this process's `Runtime`.
        sync_every: inner steps between outer steps (H, --sync-every).
        outer_lr: the outer SGD's learning rate (--outer-lr, default 0.7).
        outer_momentum: its Nesterov momentum (--outer-momentum, default 0.9; 0: none).
        outer_compress: how the pseudo-gradient travels: fp32, bf16, int8 (--outer-compress).
    """

    name = "diloco"
    Config = DiLoCoConfig

    def __init__(self, runtime: Runtime, sync_every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_compress: str = "fp32"):
        super().__init__(runtime, sync_every)
        if not 0 <= outer_momentum < 1:
            raise ConfigError(f"--outer-momentum {outer_momentum}: it must be in [0, 1)")
        if not outer_lr > 0:
            raise ConfigError(f"--outer-lr {outer_lr}: it must be positive")
        if outer_compress not in CODECS:
            raise ConfigError(f"--outer-compress {outer_compress!r}: choose one of "
                              f"{', '.join(CODECS)}")
        self.outer_lr, self.outer_momentum, self.outer_compress = (outer_lr, outer_momentum,
                                                                   outer_compress)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        super().setup(model, optimizer_fn, loss_fn)
        self.outer = OuterStep(self._params(), lr=self.outer_lr, momentum=self.outer_momentum,
                               codec=self.outer_compress)

    def _meet(self) -> None:
        self.bytes_sent += self.outer.step(self._params(), self.runtime.process_group,
                                           self.runtime.world_size)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "outer_compress": self.outer_compress}

    def round_state_dict(self) -> dict[str, Any]:
        """Local SGD's, and the outer step's anchor and momentum (the same on every rank)."""
        return {**super().round_state_dict(), "outer": self.outer.state_dict()}

    def load_round_state_dict(self, state: dict[str, Any]) -> None:
        super().load_round_state_dict(state)
        self.outer.load_state_dict(state["outer"])

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        """Local SGD's, then a fresh outer step anchored at the loaded weights: its momentum,
        a sum of past pseudo-gradients, starts again at zero (another strategy has none)."""
        super().load_portable_state_dict(state)
        self.outer = OuterStep(self._params(), lr=self.outer_lr, momentum=self.outer_momentum,
                               codec=self.outer_compress)
