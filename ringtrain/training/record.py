"""A logged step's metrics record: the window's sums and the eval sums, reduced in one call.

    rec = log_step(state, agreement, metrics, step, lr, started=t0, evaluate=None, eval_names=[])

Apart from the step loop (`trainer.py`) because it is the one place the loop's local figures
become agreed ones: what is summed across ranks and in which order, how the means and rates
are made from the sums, and the NaN check that stops a run. The loop only decides when to
call it. `eval_text` words a record's eval metrics for the log.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from ringtrain.training.evaluate import EvalSums
from ringtrain.training.progress import MetricsLog
from ringtrain.training.state import LoopState, WindowSums
from ringtrain.training.tensorboard import TensorBoardLog

__all__ = ["eval_text", "log_step"]


class Sums(Protocol):
    """What a logged step needs of the strategy's agreement (`Agreement.sum`)."""

    def sum(self, values: list[float]) -> list[float]: ...


def log_step(state: LoopState, agreement: Sums, metrics: MetricsLog | TensorBoardLog,
             step: int, lr: float, *, started: float, evaluate: Callable[[], EvalSums] | None,
             eval_names: list[str]) -> dict[str, Any]:
    """Reduce the window's sums (and eval sums) once; rank 0 writes the metrics line.

    Args:
        state: the loop's state; its window is taken, its tokens and last record updated.
        agreement: the strategy's agreement, which sums across ranks.
        metrics: where the record is written (a no-op log off rank 0).
        step, lr: the step just finished and its learning rate.
        started: `time.time()` when the run began (the record's `time_s`).
        evaluate: scores the eval set when this step evaluates, else None.
        eval_names: the eval metrics' names, in the order `evaluate` sums them.
    """
    mine, window_s, window_steps = state.take_window()  # first: it waits for the steps
    ev = evaluate() if evaluate is not None else None
    # One reduction for both: the names' fixed order makes them one flat list.
    r = agreement.sum(mine.flat() + (ev.flat() if ev else []))
    w = WindowSums.of(r[:len(mine.flat())])
    state.tokens += w.tokens
    steps = w.worker_steps  # the times are averaged over the steps of ranks that read data
    rec: dict[str, Any] = {
        "step": step, "loss": w.loss_sum / w.count if w.count else float("nan"), "lr": lr,
        "time_s": time.time() - started,  # since the run began (time to a loss)
        "tokens_per_s": w.tokens / window_s if window_s > 0 else 0.0,
        "step_s": window_s / window_steps,
        "compute_s": w.compute_s / steps if steps else 0.0,
        "comm_s": w.comm_s / steps if steps else 0.0,
    }
    if ev is not None:
        rec.update(EvalSums.of(r[len(mine.flat()):], eval_names).means())
    if not math.isfinite(rec["loss"]) and w.count:
        raise FloatingPointError(
            f"the training loss became {rec['loss']} at step {step} (lr {lr:.3g}); lower --lr, "
            "set --grad-clip, or use --dtype fp32")
    metrics.write(rec)
    state.last.update(rec)
    return rec


def eval_text(rec: dict[str, Any]) -> str:
    """A record's eval metrics as `eval_loss 1.2345, eval_acc 0.5000` for the log."""
    return ", ".join(f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("eval_"))
