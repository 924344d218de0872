"""A logged step's metrics record: the window's sums and the eval sums, reduced in one call.

    rec = log_step(state, agreement, metrics, step, lr, started=t0, evaluate=None, eval_names=[])

Apart from the step loop (`trainer.py`) because it is the one place the loop's local figures
become agreed ones: what is summed across ranks and in which order, how the means and rates
are made from the sums, and the NaN check that stops a run. The loop only decides when to
call it. In a live job a sum can fail (a member lost since the step committed): that line is
held (`HeldLine`) and agreed in the next logged step's reduction, so the writer of then (the
current generation's rank 0) writes every line once, in order. `eval_text` words a record's
eval metrics for the log.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from ringtrain.training.evaluate import EvalSums
from ringtrain.training.state import RATES, LoopState, WindowSums, rate_unit

__all__ = ["HeldLine", "eval_text", "flush_held", "log_step"]

log = logging.getLogger("ringtrain")


class Sums(Protocol):
    """What a logged step needs of the strategy's agreement (`Agreement.sum`, `try_sum`)."""

    def sum(self, values: list[float]) -> list[float]: ...

    def try_sum(self, values: list[float]) -> list[float] | None: ...


class Lines(Protocol):
    """Where a metrics line goes (`RankZeroMetrics`, or a `MetricsLog`)."""

    def write(self, record: dict[str, Any]) -> None: ...


def log_step(state: LoopState, agreement: Sums, metrics: Lines,
             step: int, lr: float, *, started: float, evaluate: Callable[[], EvalSums] | None,
             eval_names: list[str], held: HeldLine | None = None) -> dict[str, Any]:
    """Reduce the window's sums (and eval sums) once; rank 0 writes the metrics line.

    Args:
        state: the loop's state; its window is taken, its tokens and last record updated.
        agreement: the strategy's agreement, which sums across ranks.
        metrics: where the record is written (nothing off rank 0).
        step, lr: the step just finished and its learning rate.
        started: `time.time()` when the run began (the record's `time_s`).
        evaluate: scores the eval set when this step evaluates, else None.
        eval_names: the eval metrics' names, in the order `evaluate` sums them.
        held: a live job's line held from a failed sum (`HeldLine`), carried in this step's
            reduction and written before this step's line; None: every sum is agreed or raises.
    """
    mine, window_s, window_steps = state.take_window()  # first: it waits for the steps
    ev = evaluate() if evaluate is not None else None
    # One reduction for both: the names' fixed order makes them one flat list.
    own = mine.flat() + (ev.flat() if ev else [])
    if held is None:
        r = agreement.sum(own)
    else:
        slot = held.slot()
        both = agreement.try_sum(slot + own)
        if both is None:  # a member lost since the step committed: each survivor has its own
            w = WindowSums.of(own[:len(mine.flat())])
            rec = _record(w, ev, eval_names, step=step, lr=lr, time_s=time.time() - started,
                          window_s=window_s, window_steps=window_steps,
                          unit=rate_unit(w, state.unit))
            held.hold(rec, own, window_s=window_s, window_steps=window_steps)
            state.last.update(rec)  # this member's view, until an agreed line replaces it
            # No eval figures: the members' differ, and an early stop must be everyone's.
            return {k: v for k, v in rec.items() if not k.startswith("eval_")}
        late = held.release(both[:len(slot)])
        if late is not None:  # the line of the step whose sum failed, before this step's
            rec, tokens = late
            state.tokens += tokens
            metrics.write(rec)
        r = both[len(slot):]
    w = WindowSums.of(r[:len(mine.flat())])
    state.tokens += w.tokens
    state.unit = rate_unit(w, state.unit)  # from the sums: the same on every rank
    rec = _record(w, EvalSums.of(r[len(mine.flat()):], eval_names) if ev is not None else None,
                  eval_names, step=step, lr=lr, time_s=time.time() - started, window_s=window_s,
                  window_steps=window_steps, unit=state.unit)
    if not math.isfinite(rec["loss"]) and w.count:
        raise FloatingPointError(
            f"the training loss became {rec['loss']} at step {step} (lr {lr:.3g}); lower --lr, "
            "set --grad-clip, or use --dtype fp32")
    metrics.write(rec)
    state.last.update(rec)
    return rec


def flush_held(held: HeldLine | None, agreement: Sums, metrics: Lines,
               state: LoopState) -> bool:
    """At a live run's end: agree on a line still held (one member's is enough) and write it.
    False when the sum failed: a member was lost after the last step (recover, then ask again).
    `held` None (not a live run): nothing to agree on."""
    if held is None:
        return True
    summed = agreement.try_sum(held.slot())
    if summed is None:
        return False
    late = held.release(summed)
    if late is not None:
        state.tokens += late[1]
        metrics.write(late[0])
        state.last.update(late[0])  # the run's last line: summary.json's figures
    return True


def _record(w: WindowSums, ev: EvalSums | None, eval_names: list[str], *, step: int, lr: float,
            time_s: float, window_s: float, window_steps: float, unit: str) -> dict[str, Any]:
    """A metrics line from summed window (and eval) sums: means and rates from the sums; the
    rate's key is the unit's (`state.RATES`, `state.rate_unit`)."""
    steps = w.worker_steps  # the times are averaged over the steps of ranks that read data
    rec: dict[str, Any] = {
        "step": step, "loss": w.loss_sum / w.count if w.count else float("nan"), "lr": lr,
        "time_s": time_s,  # since the run began (time to a loss)
        RATES[unit][0]: w.tokens / window_s if window_s > 0 else 0.0,
        "step_s": window_s / window_steps if window_steps else 0.0,
        "compute_s": w.compute_s / steps if steps else 0.0,
        "comm_s": w.comm_s / steps if steps else 0.0,
    }
    if ev is not None:
        rec.update(ev.means())
    return rec


class HeldLine:
    """A live job's metrics line whose sums its members could not agree on, held for the next.

    A member lost between a step's commit and that step's reduction (`Agreement.try_sum` says
    None) leaves each survivor with its own sums only, and the member lost may be the rank 0
    that writes. So the line is not written then: each survivor holds it, and every logged
    step's one reduction carries a slot for it (the holders' sums, zeros from a member let in
    since). Once a generation agrees, its rank 0 writes the held line (the survivors' sums:
    the lost member's share of that window is gone with it), then the step's own line: one
    line per logged step, in order, whoever writes.

    One line is held at most: a second failed sum before the first is agreed drops the newer
    line, and slots that disagree on the step (members that held different lines) drop theirs;
    a warning names the step either way.

    Args:
        eval_names: the eval metrics' names (fixes the slot's width on every member).
    """

    _HEAD = 8  # holders, sum of steps, sum of squared steps, lr, time_s, window_s, steps, eval

    def __init__(self, eval_names: list[str]):
        self.eval_names, self.unit = list(eval_names), "tokens"
        self._window = len(WindowSums().flat())
        self.width = self._HEAD + self._window + 2 + 2 * len(self.eval_names)
        self._slot: list[float] | None = None

    @property
    def step(self) -> int | None:
        """The held line's step, or None."""
        return None if self._slot is None else int(self._slot[1])

    def hold(self, rec: dict[str, Any], sums: list[float], *, window_s: float,
             window_steps: int) -> None:
        """Hold the line of `rec` (this member's `sums`: window, then eval sums if evaluated)."""
        step = rec["step"]
        if self._slot is not None:
            log.warning("live: the metrics line of step %d is dropped: its sum failed while the "
                        "line of step %d was still held (two members lost in one window)",
                        step, self.step)
            return
        evaluated = len(sums) > self._window
        tail = sums + [0.0] * (self.width - self._HEAD - len(sums))
        self._slot = [1.0, step, step * step, rec["lr"], rec["time_s"], window_s, window_steps,
                      1.0 if evaluated else 0.0, *tail]

    def slot(self) -> list[float]:
        """This member's part of the next reduction: its held line, or zeros."""
        return list(self._slot) if self._slot is not None else [0.0] * self.width

    def release(self, summed: list[float]) -> tuple[dict[str, Any], float] | None:
        """From the summed slot (the same on every member): the held line's record and its
        tokens, or None when nobody held one (or the holders disagree: dropped, warned)."""
        self._slot = None  # agreed: every holder let go of it
        n = summed[0]
        if n == 0:
            return None
        steps, squares = summed[1], summed[2]
        if squares * n != steps * steps:  # not all the same step: the sums are not one line's
            log.warning("live: the held metrics lines disagree on their step (%d holders, "
                        "steps summing to %g): dropped", n, steps)
            return None
        lr, time_s, window_s, window_steps, evaluated = (v / n for v in summed[3:self._HEAD])
        w = WindowSums.of(summed[self._HEAD:self._HEAD + self._window])
        ev = EvalSums.of(summed[self._HEAD + self._window:], self.eval_names) \
            if evaluated else None
        self.unit = rate_unit(w, self.unit)
        rec = _record(w, ev, self.eval_names, step=round(steps / n), lr=lr, time_s=time_s,
                      window_s=window_s, window_steps=window_steps, unit=self.unit)
        return rec, w.tokens


def eval_text(rec: dict[str, Any]) -> str:
    """A record's eval metrics as `eval_loss 1.2345, eval_acc 0.5000` for the log."""
    return ", ".join(f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("eval_"))
