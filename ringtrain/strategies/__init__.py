"""Strategies: how a rank holds the model, meets its peers' gradients and saves state.

Read `base.py` first (the seam the trainer talks to), then `ddp.py` (the simplest), then
`pipeline.py` and `ps.py`. Each module here holds one `Strategy` subclass with a `name`; it is
found by that name (`--strategy NAME`, `make_strategy(NAME, ...)`) without a list to edit.
Each strategy's options are its `Config` dataclass (`base.StrategyConfig`), declared in its
module, with what it costs in numbers (`figures.py`, for `ringtrain explain`; `layouts.py`: a
GPT's dp x pp x tp layouts, for `ringtrain plan` and `--strategy tp`). `portable.py` is
the layout-free form of a strategy's state (parameters and optimizer state by name) that lets a
snapshot of one strategy or layout resume in any other: each strategy converts to and from it.
May import: `ringtrain.config`, `ringtrain.ddp`, `ringtrain.pipeline`, `ringtrain.ps`,
`ringtrain.localsgd`, `ringtrain.zero`, `ringtrain.tensor_parallel` (the engines),
`ringtrain.agreement`, `ringtrain.runtime`, `ringtrain.errors`, `ringtrain.types`,
`ringtrain.trace`, `ringtrain.collectives`, `ringtrain.grid`, `ringtrain.tensor_tree`,
`ringtrain.flat_sum`. Never the trainer or the command line.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from ringtrain.errors import ConfigError
from ringtrain.strategies.base import EvalShard, StepResult, Strategy, StrategyConfig

__all__ = ["EvalShard", "StepResult", "Strategy", "StrategyConfig", "make_strategy", "registered"]

_NOT_STRATEGIES = {"base"}


def registered() -> dict[str, type[Strategy]]:
    """--strategy name -> class, for every strategy module in this package (sorted by name)."""
    found: dict[str, type[Strategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_STRATEGIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Strategy) and value.name
                    and value.__module__ == module.__name__):
                if value.name in found:
                    raise TypeError(f"two strategies are named {value.name!r}: "
                                    f"{found[value.name].__module__} and {module.__name__}")
                found[value.name] = value
    return dict(sorted(found.items()))


def make_strategy(name: str, **options: Any) -> Strategy:
    """Build the strategy registered as `name` with its options (e.g. pp=2, schedule='1f1b')."""
    strategies = registered()
    if name not in strategies:
        raise ConfigError(f"--strategy {name!r} is not known; choose one of {sorted(strategies)}")
    cls = strategies[name]
    takes = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        accepted = [n for n, p in takes.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
        if unknown := sorted(set(options) - set(accepted)):
            raise ConfigError(f"make_strategy({name!r}): {', '.join(map(repr, unknown))} "
                              f"{'is' if len(unknown) == 1 else 'are'} not an option of the "
                              f"{name} strategy, which takes {', '.join(accepted)}")
    return cls(**options)
