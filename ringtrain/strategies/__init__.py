"""Strategies: how a rank holds the model, meets its peers' gradients and saves state.

The trainer talks only to `Strategy` (see `base.py`); `make_strategy(name, ...)` builds one.
Each strategy module registers itself in `STRATEGIES` under the `--strategy` name it answers to.
"""

from ringtrain.strategies.base import STRATEGIES, StepResult, Strategy, make_strategy

__all__ = ["STRATEGIES", "StepResult", "Strategy", "make_strategy"]
