"""What `ringtrain explain` says of a strategy, in words each Strategy class supplies.

    ringtrain explain runs/a      # cli/explain.py asks the run's strategy class

`Strategy.explain(facts)` gets the `RunFacts` of a finished (or stopped) run, read from its
config.json and summary.json, and returns an `Explanation`: who did what, who read the data,
what travelled between ranks per step, and what its "communication" time is made of. The base
class says what it can from the class's docstring; each strategy that knows better overrides it,
so a new strategy is explained without touching the command.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

FP32_BYTES = 4  # gradients, parameters and activations travel in fp32 (under bf16 autocast too)


@dataclass(frozen=True)
class RunFacts:
    """A run, as far as a strategy's explanation needs it."""

    name: str  # --strategy
    cls: Any  # its Strategy class; None for one this ringtrain does not know
    options: dict[str, Any]  # its options as set on the command line
    world: int
    params: int
    step_batch: int  # samples per data rank per step: --batch-size x --grad-accum
    data_ranks: int
    model: dict[str, Any] = field(default_factory=dict)  # config.json's model section
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json ({}: did not finish)

    def option(self, name: str) -> Any:
        """An option's value: as given, else the strategy constructor's own default."""
        return self.options.get(name, inspect.signature(self.cls.__init__).parameters[name].default)

    @property
    def grad_bytes(self) -> int:
        """The model's gradients (or parameters) in fp32."""
        return self.params * FP32_BYTES

    def ring_share(self, ranks: int | None = None) -> float:
        """Bytes a rank sends in a ring all-reduce, per byte of the buffer: 2(N-1)/N."""
        n = self.world if ranks is None else ranks
        return 2 * (n - 1) / n


@dataclass(frozen=True)
class Explanation:
    """The strategy's part of `ringtrain explain`'s text; each line is wrapped by the command."""

    roles: list[str]  # "who did what"
    traffic: list[str]  # "what travelled between ranks, per step"
    reader: str = "as the strategy plans"  # who reads data, in the data section
    waiting: str = "what the strategy reports as waiting"  # "communication is ..."


def n(x: float) -> str:
    return f"{x:,.0f}"


def nbytes(x: float) -> str:
    return f"{n(x)} bytes" if x < 1e6 else f"{x / 1e6:,.2f} MB"


def plural(count: int, word: str) -> str:  # '1 rank', '2 ranks'
    return f"{count} {word}{'' if count == 1 else 's'}"


def ranks(first: int, last: int) -> str:  # 'rank 2', 'ranks 0..1'
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def generic(facts: RunFacts) -> Explanation:
    """What can be said of any strategy: its docstring's first line, the model's size."""
    what = (inspect.getdoc(facts.cls) or "").splitlines()[0] if facts.cls else \
        "not known to this ringtrain"
    return Explanation(
        roles=[f"{facts.world} ranks, --strategy {facts.name}: {what}"],
        traffic=[f"not estimated for --strategy {facts.name}; the model has {n(facts.params)} "
                 f"parameters ({nbytes(facts.grad_bytes)} in fp32)."])
