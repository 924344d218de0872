"""`ZeroOptimizer`: the user's optimizer rebuilt over this rank's parts of the parameters.

Used by `ZeroDataParallel` (`sharded.py`), which hands it the units and what to do after a step
(stages 1 and 2 start spreading the updated parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ringtrain.zero.units import FlatUnit

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's optimizer over this rank's parts of the parameters; `step()` then spreads them.

    Built from `optimizer_fn` the way torch's `ZeroRedundancyOptimizer` builds from
    `optimizer_class`: groups and their options are kept, each group holding the owned parts of
    its parameters (1-D views into the unit shards; the user's parameters are never stepped).
    A `torch.optim.Optimizer` to torch, whose LR schedulers take nothing else, without
    `Optimizer.__init__`: `param_groups`, `state` and `defaults` are the rebuilt optimizer's,
    so a scheduler's learning rates are the ones stepped; step hooks are registered on it.
    """

    def __init__(self, module: nn.Module, units: Sequence[FlatUnit], optimizer_fn: OptimizerFactory,
                 after_step: Callable[[], None]):
        self.units, self.after_step = list(units), after_step
        template = optimizer_fn(module.parameters())  # no state yet: optimizers are lazy
        parts: dict[int, list[nn.Parameter]] = {}
        # (part, unit index, first element in the unit's shard, elements): where each part's
        # optimizer state sits in the unit's flat layout (`reshard.py` saves it that way).
        self.locations: list[tuple[nn.Parameter, int, int, int]] = []
        for k, unit in enumerate(self.units):
            for p, piece, grad in unit.pieces():
                part = nn.Parameter(piece)  # shares the shard's storage
                part.grad = grad  # a view of the shard's gradient, filled by the reduce
                parts.setdefault(id(p), []).append(part)
                start = piece.storage_offset() - unit.shard.storage_offset()
                self.locations.append((part, k, start, piece.numel()))
        groups = []
        for g in template.param_groups:
            opts = {k: v for k, v in g.items() if k != "params"}
            groups.append({**opts,
                           "params": [q for p in g["params"] for q in parts.get(id(p), [])]})
        if not any(g["params"] for g in groups):  # a rank that owns nothing (a tiny model)
            groups[0]["params"] = [nn.Parameter(torch.empty(0))]
        # Every group carries all its options (torch fills them in from the defaults), so the
        # constructor's own defaults never apply; some of torch's defaults are not arguments.
        self.optimizer = type(template)(groups)
        self.optimizer.defaults = dict(template.defaults)

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step(closure) is not supported: run forward and "
                             "backward yourself, then call step()")
        self.optimizer.step()
        self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (the shard gradients stay allocated: the reduce writes into them)."""
        for unit in self.units:
            unit.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """`hook(optimizer, args, kwargs)` before each step, called with this optimizer."""
        return self.optimizer.register_step_pre_hook(lambda _o, a, k: hook(self, a, k))

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """`hook(optimizer, args, kwargs)` after each step's update (before the spread)."""
        return self.optimizer.register_step_post_hook(lambda _o, a, k: hook(self, a, k))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("ZeroOptimizer.add_param_group: ZeRO shards the parameters the wrapper "
                         "was built with; give every group to optimizer_fn when building "
                         "ZeroDataParallel")

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"
