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

from typing import Any

from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.localsgd.compress import CODECS
from ringtrain.localsgd.outer import OuterStep
from ringtrain.runtime import Runtime
from ringtrain.strategies.base import Option, non_negative_float
from ringtrain.strategies.explaining import RunFacts
from ringtrain.strategies.localsgd import LocalSGDStrategy
from ringtrain.types import LossFn, OptimizerFn


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
    options = LocalSGDStrategy.options + (
        Option("--outer-lr", "outer_lr", non_negative_float, help="DiLoCo's outer learning rate "
               "(default: 0.7)"),
        Option("--outer-momentum", "outer_momentum", non_negative_float, help="DiLoCo's outer Nesterov "
               "momentum, 0 for none (default: 0.9)"),
        Option("--outer-compress", "outer_compress", choices=CODECS, help="how the "
               "pseudo-gradient travels (default: fp32)"),
    )

    @classmethod
    def _meeting_words(cls, f: RunFacts) -> str:
        codec = f.option("outer_compress")
        how = ("all-reduced in fp32" if codec == "fp32" else f"all-gathered in {codec}"
               + (" with one fp32 scale per tensor" if codec == "int8" else "")
               + " and summed in fp32 in rank order")
        return (f"each rank's pseudo-gradient (the weights of the last outer step minus its "
                f"weights now) is {how}, and the mean moves the shared weights by an outer SGD "
                f"with Nesterov momentum (--outer-lr {f.option('outer_lr')}, --outer-momentum "
                f"{f.option('outer_momentum')}), the same step on every rank (DiLoCo).")

    @classmethod
    def _meeting_bytes(cls, f: RunFacts) -> float:
        codec = f.option("outer_compress")
        if codec == "fp32":
            return f.ring_share() * f.grad_bytes
        return (f.params * (2 if codec == "bf16" else 1)) * (f.world - 1)  # all-gather

    def __init__(self, runtime: Runtime, sync_every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_compress: str = "fp32"):
        super().__init__(runtime, sync_every)
        if not 0 <= outer_momentum < 1:
            raise ConfigError(f"--outer-momentum {outer_momentum}: it must be in [0, 1)")
        if not outer_lr > 0:
            raise ConfigError(f"--outer-lr {outer_lr}: it must be positive")
        if outer_compress not in CODECS:
            raise ConfigError(f"--outer-compress {outer_compress!r}: choose one of {', '.join(CODECS)}")
        self.outer_lr, self.outer_momentum, self.outer_compress = outer_lr, outer_momentum, outer_compress

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

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer"])
