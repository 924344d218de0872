"""The end of a finished run, in the order that keeps the ranks together.

    end = RunEnd(strategy, tracer, eval_names, run_dir=run_dir, sample_fn=sample_fn,
                 model=model, model_fn=model_fn)
    agreed = end.agree(runtime, agreement, loop_state, config, data_world_size, started=t0,
                       live=False)                        # every rank, right after the last step
    snapshots.wait()                                      # then the last snapshot's write
    summary = end.write(agreed, runtime, checkpointer, records, report=True)   # rank 0's files

Apart from the step loop (`trainer.py`) because its order is its point. What needs every rank
comes first: the whole final model (ZeRO stage 3 gathers its parameters: a collective), its
digest compared across ranks, the summary's figures gathered (a live job's speed, the trace).
Only then does a rank join its last snapshot's write in the background: in a live job the
members' rank 0 writes alone, and had it waited for that write first, the others would wait in
the gather for as long, and a write longer than the group's collective timeout
(`--watchdog-timeout`) failed the run's end (issue 26). Then the snapshot's figures, which the
write's end sets, and rank 0's files (`summary.py`: summary.json, report.png, a sample).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ringtrain.checkpoint.resume import Checkpointer
from ringtrain.runtime import Runtime
from ringtrain.strategies.base import Strategy
from ringtrain.trace import Tracer
from ringtrain.training.config import TrainerConfig
from ringtrain.training.state import LoopState
from ringtrain.training.summary import agreed_sha256, eager_copy, run_summary, write_run_files

__all__ = ["Agreed", "RunEnd"]


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on at the end (`RunEnd.agree`), for `RunEnd.write`."""

    summary: dict[str, Any]  # the loop's part of summary.json (`run_summary`)
    figures: dict[str, Any]  # the strategy's own and the trace's: after the snapshot's
    started: float  # `time.time()` when the run began: `wall_s` counts the last write too


class RunEnd:
    """A run's end (see the module docstring); holds the final model's state after `agree`.

    Args:
        strategy: the set-up strategy the loop trained.
        tracer: the run's `Tracer` (`--trace-steps`), finished here.
        eval_names: the eval metrics' names, in the summary's order.
        run_dir: where rank 0 writes the files (None: none).
        sample_fn: given the final model on rank 0, a short text for the summary.
        model, model_fn: the model the strategy was given and how to build a fresh one
            (`eager_copy`: `model` may hold slices, or be compiled).
    """

    def __init__(self, strategy: Strategy, tracer: Tracer, eval_names: list[str], *,
                 run_dir: str | None, sample_fn: Callable[[nn.Module], str] | None,
                 model: nn.Module, model_fn: Callable[[], nn.Module]):
        self.strategy, self.tracer, self.eval_names = strategy, tracer, eval_names
        self.run_dir, self.sample_fn = run_dir, sample_fn
        self.model, self.model_fn = model, model_fn
        self.final_state: dict[str, Any] | None = None  # model_state_dict() at the end

    def agree(self, runtime: Runtime, agreement: Any, loop: LoopState, config: TrainerConfig,
              data_world_size: int, *, started: float, live: bool) -> Agreed:
        """Every rank, right after the last step: the end's collectives, before any rank
        waits for a write of its own (the module docstring says why)."""
        s = self.strategy
        self.final_state = state = s.model_state_dict()  # ZeRO 3: gathered, a collective
        sha = agreed_sha256(state, runtime, agreement)
        summary = run_summary(loop, s, runtime, config, data_world_size, self.eval_names,
                              steps=loop.step, started=started, sha=sha,
                              gather=agreement.gather if live else None)
        figures = dict(s.stats())  # the strategy's own figures (a parameter server's staleness)
        figures.update(self.tracer.finish(agreement.gather, self.run_dir))  # --trace-steps
        return Agreed(summary, figures, started)

    def write(self, agreed: Agreed, runtime: Runtime, checkpointer: Checkpointer | None,
              records: list[dict[str, Any]], *, report: bool) -> dict[str, Any]:
        """After the last snapshot's write was joined: the summary (on every rank), and on
        rank 0 the sample and the run's files. The keys in summary.json's order."""
        summary = dict(agreed.summary)
        summary["wall_s"] = time.time() - agreed.started  # the whole run, its last write too
        if checkpointer is not None:
            summary.update(checkpointer.summary())
        summary.update(agreed.figures)
        if runtime.rank != 0:
            return summary
        if self.sample_fn is not None:
            summary["sample"] = self.sample_fn(self.final_model())
        if self.run_dir:
            summary["run_dir"] = self.run_dir
            disk_full = write_run_files(
                self.run_dir, summary, records,
                title=f"{self.strategy.name}, world_size {runtime.world_size}", report=report,
                saved_step=checkpointer.saved_step if checkpointer else None)
            if disk_full is not None:
                summary["disk_full"] = disk_full
        return summary

    def final_model(self) -> nn.Module:
        """The whole final model as a plain, uncompiled module (`eager_copy`)."""
        if self.final_state is None:
            raise RuntimeError("Trainer.final_model() is the model after fit(): call fit() first")
        return eager_copy(self.model, self.final_state, model_fn=self.model_fn)
