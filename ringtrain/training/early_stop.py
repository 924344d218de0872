"""Stopping early (`Trainer(stop_when=...)`): one rule, asked by the loop after an evaluated
step's metrics line, and by a resume at the step it resumes (a run stopped there trains
nothing when run again, as a run resumed at its last step).

The decision reads only a record's reduced values (bit-identical on every rank: `agreed`), so
every rank stops at the same step; an early stop's step has a snapshot (the trainer saves it),
whose loop state holds that step's record (`LoopState.last`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ringtrain.training.record import eval_text

__all__ = ["agreed", "evaluates", "stop_met", "stopped_at"]

StopWhen = Callable[[dict[str, Any]], bool] | None
log = logging.getLogger("ringtrain")


def agreed(rec: dict[str, Any]) -> dict[str, Any]:
    """A record's reduced values: what a stop decides on (its timings are each rank's own)."""
    return {k: v for k, v in rec.items() if k in ("step", "loss", "lr") or k.startswith("eval_")}


def evaluates(step: int, *, eval_every: int, steps: int) -> bool:
    """Whether the loop evaluates after `step` (where it has an eval set): every `eval_every`
    steps and after the last."""
    return step % eval_every == 0 or step == steps


def stop_met(rec: dict[str, Any], stop_when: StopWhen) -> bool:
    """Whether an evaluated step's record meets `stop_when` (None: never stops early)."""
    return stop_when is not None and bool(stop_when(agreed(rec)))


def stopped_at(last: dict[str, Any], step: int, stop_when: StopWhen, *, eval_every: int,
               steps: int, say: bool = False) -> bool:
    """Whether a run resumed at `step`, whose newest record is `last`, stopped there: `step`
    evaluated, `last` is its record, and its figures meet `stop_when` (an early stop's own
    snapshot, or a condition now met there). Else the run goes on from `step`. `say`: log it
    (rank 0)."""
    if not (last.get("step") == step and evaluates(step, eval_every=eval_every, steps=steps)
            and stop_met(last, stop_when)):
        return False
    if say:
        log.info("the run stopped early at step %d (%s): its stop condition holds there, so "
                 "nothing is left to train (a condition it does not meet there goes on from it, "
                 "e.g. a higher --stop-at-accuracy; --no-resume starts afresh)", step,
                 eval_text(last))
    return True
