"""The training loop's own state: what a snapshot must hold besides the model and optimizer.

    state = LoopState(sampler)
    shared = state.state_dict()          # rank 0's part: step, totals, sampler cursor, resumes
    mine = state.window_state()          # each rank's part: its metrics window since the last line

The step counter and the sampler's position say where the run is; the metrics window (sums
since the last metrics line) is per rank and saved per rank, so the logged losses after a
resume are the ones the run would have logged; on another world size rank 0 carries the
window's sum over the old ranks (`restart_window`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.data.sample_log import SampleLog
from ringtrain.data.sampler import DistributedSampler
from ringtrain.errors import ConfigError

# The metrics window's sums: loss_sum, count, tokens, compute_s, comm_s, steps of data ranks.
WINDOW_FIELDS = ("loss_sum", "count", "tokens", "compute_s", "comm_s", "data_rank_steps")


def _empty_window() -> list[float]:
    return [0.0] * len(WINDOW_FIELDS)


@dataclass
class LoopState:
    """Step, metrics window, token count and sampler cursor of one rank's training loop.

    Args:
        sampler: this rank's training sampler (its epoch and cursor are saved); None on a
            rank that reads no data.
    """

    sampler: DistributedSampler | None = None
    step: int = 0
    train_time_s: float = 0.0  # rank 0's time in training steps (excludes eval and logging)
    tokens: float = 0.0  # tokens trained on, all ranks
    last: dict[str, Any] = field(default_factory=dict)  # the newest reduced metrics
    resumes: list[dict[str, Any]] = field(default_factory=list)  # one entry per resume
    _sums: list[float] = field(default_factory=_empty_window, repr=False)
    # Sums still on the device (index -> 0-dim tensor): a strategy's loss sum is not read back
    # each step, which would make the host wait for the device every step; `window` reads them.
    _pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    window_s: float = 0.0
    window_steps: int = 0
    samples: SampleLog | None = None  # each step's sample indices (--record-samples), or None

    # -- the metrics window ------------------------------------------------------------------
    @property
    def window(self) -> list[float]:
        """The window's sums as numbers (in `WINDOW_FIELDS` order). Reading it waits for the
        device once, for the sums still there: do it on metrics and snapshot steps only."""
        for i, t in self._pending.items():
            self._sums[i] = float(t)
        self._pending = {}
        return self._sums

    @window.setter
    def window(self, sums: list[float]) -> None:
        self._sums, self._pending = list(sums), {}

    def add(self, values: tuple[float | torch.Tensor, ...], seconds: float) -> None:
        """One step's sums (in `WINDOW_FIELDS` order) and time into the window; a tensor (a
        loss sum on the device) stays there until `window` is read."""
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                # The same additions, in the same order, as on numbers: the window's value so
                # far enters the device sum first, so the result is the same bit for bit.
                held = self._pending.get(i)
                self._pending[i] = v + self._sums[i] if held is None else held + v
            elif i in self._pending:
                self._pending[i] = self._pending[i] + v
            else:
                self._sums[i] += v
        self.window_s += seconds
        self.window_steps += 1
        self.train_time_s += seconds

    def take_window(self) -> tuple[list[float], float, int]:
        """The window's (sums, seconds, steps), leaving it empty for the next metrics line.

        The time reading the sums waits is counted as the window's: it is the device finishing
        the steps the host queued (their host times alone would overstate the throughput).
        """
        t0 = time.perf_counter()
        sums = self.window
        waited = time.perf_counter() - t0
        self.window_s += waited
        self.train_time_s += waited
        out = (sums, self.window_s, self.window_steps)
        self.window, self.window_s, self.window_steps = _empty_window(), 0.0, 0
        return out

    # -- snapshots -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The shared part (rank 0's): step, totals, sampler (epoch, global cursor), resumes."""
        return {"step": self.step, "train_time_s": self.train_time_s, "tokens": self.tokens,
                "sampler": self.sampler.state_dict() if self.sampler else None,
                "last": dict(self.last), "resumes": [dict(r) for r in self.resumes],
                **({"samples": self.samples.state_dict()} if self.samples is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.train_time_s, self.tokens = state["step"], state["train_time_s"], state["tokens"]
        if self.sampler and state.get("sampler"):
            self.sampler.load_state_dict(state["sampler"])  # re-split if num_replicas differs
        self.last = dict(state.get("last", {}))
        self.resumes = [dict(r) for r in state.get("resumes", [])]
        if self.samples is not None:  # the committed history; later steps are trained again
            if "samples" not in state and self.step > 0:
                raise ConfigError(f"--record-samples: the snapshot of step {self.step} holds no "
                                  "sample history (saved without --record-samples); resume "
                                  "without it, or start afresh with --no-resume")
            if "samples" in state:
                self.samples.load_state_dict(state["samples"])

    def window_state(self) -> dict[str, Any]:
        """This rank's part: its metrics window."""
        return {"window": list(self.window), "window_s": self.window_s,
                "window_steps": self.window_steps}

    def load_window_state(self, state: dict[str, Any]) -> None:
        self.window = list(state["window"])
        self.window_s, self.window_steps = state["window_s"], state["window_steps"]

    def restart_window(self, window_sum: list[float], *, holder: bool) -> None:
        """After a resume on other ranks: the `holder` (rank 0) carries every old rank's sums."""
        self.window = list(window_sum) if holder else [0.0] * len(window_sum)
        self.window_s, self.window_steps = 0.0, 0
