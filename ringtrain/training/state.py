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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ringtrain.data.sample_log import SampleLog
from ringtrain.data.sampler import DistributedSampler
from ringtrain.errors import ConfigError

# a rate's unit -> its metrics.jsonl / summary.json key and the progress bar's label
RATES = {"tokens": ("tokens_per_s", "tok/s"), "samples": ("samples_per_s", "samples/s")}


def token_ids(inputs: Any) -> bool:
    """Whether a batch's inputs are token ids (integers: a language model's), whose rate counts
    tokens (`tokens_per_s`); any other input's counts samples (`samples_per_s`): an image's
    floats are no tokens."""
    return isinstance(inputs, torch.Tensor) and not (
        inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool)


def rate_unit(w: WindowSums, before: str) -> str:
    """The unit of a summed window's rate: every rank's alike (decided from the sums); a window
    in which no rank read data keeps the one `before`."""
    return before if not w.count else "tokens" if w.id_samples else "samples"


@dataclass
class WindowSums:
    """One rank's metric sums over the steps since the last metrics line, by name.

    The ranks sum them as one flat list (`flat`, iterating gives the same), in the order of the
    fields: every rank runs this code, so the order is the same on all; `of` reads it back.
    `loss_sum` may be a 0-dim device tensor while the window fills (`LoopState.add`).
    """

    loss_sum: float = 0.0  # sum over samples of the per-sample mean loss
    count: float = 0.0  # samples behind loss_sum
    tokens: float = 0.0  # tokens trained on (samples, where the inputs are no token ids)
    compute_s: float = 0.0  # forward + backward + optimizer time
    comm_s: float = 0.0  # time waiting on communication
    worker_steps: float = 0.0  # steps of ranks that read data (the times are averaged over them)
    id_samples: float = 0.0  # samples whose inputs were token ids (`token_ids`)

    def flat(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    def __iter__(self) -> Iterator[float]:  # `list(window)`: what the checkpointer sums
        return iter(self.flat())

    @classmethod
    def of(cls, values: list[float] | dict[str, float]) -> WindowSums:
        """From `flat()`'s list (a sum over ranks) or a saved dict by name."""
        if isinstance(values, dict):
            return cls(**values)
        names = [f.name for f in fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"{len(values)} window sums, expected {len(names)} ({names})")
        return cls(*values)


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
    tokens: float = 0.0  # tokens trained on, all ranks (or samples: `unit`)
    unit: str = "tokens"  # what `tokens` counts (`rate_unit`): the rate's key and label
    last: dict[str, Any] = field(default_factory=dict)  # the newest reduced metrics
    resumes: list[dict[str, Any]] = field(default_factory=list)  # one entry per resume
    _sums: WindowSums = field(default_factory=WindowSums, repr=False)
    # Sums still on the device (name -> 0-dim tensor): a strategy's loss sum is not read back
    # each step, which would make the host wait for the device every step; `window` reads them.
    _pending: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    window_s: float = 0.0
    window_steps: int = 0
    samples: SampleLog | None = None  # each step's sample indices (--record-samples), or None

    # -- the metrics window ------------------------------------------------------------------
    @property
    def window(self) -> WindowSums:
        """The window's sums as numbers. Reading it waits for the device once, for the sums
        still there: do it on metrics and snapshot steps only."""
        for name, t in self._pending.items():
            setattr(self._sums, name, float(t))
        self._pending = {}
        return self._sums

    @window.setter
    def window(self, sums: WindowSums | list[float]) -> None:
        self._sums, self._pending = WindowSums.of(list(sums)), {}

    def add(self, step: WindowSums, seconds: float) -> None:
        """One step's sums and time into the window; a tensor (a loss sum on the device) stays
        there until `window` is read."""
        for f in fields(step):
            name, v = f.name, getattr(step, f.name)
            if isinstance(v, torch.Tensor):
                # The same additions, in the same order, as on numbers: the window's value so
                # far enters the device sum first, so the result is the same bit for bit.
                held = self._pending.get(name)
                self._pending[name] = v + getattr(self._sums, name) if held is None else held + v
            elif name in self._pending:
                self._pending[name] = self._pending[name] + v
            else:
                setattr(self._sums, name, getattr(self._sums, name) + v)
        self.window_s += seconds
        self.window_steps += 1
        self.train_time_s += seconds

    def take_window(self) -> tuple[WindowSums, float, int]:
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
        self.window, self.window_s, self.window_steps = WindowSums(), 0.0, 0
        return out

    # -- snapshots -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The shared part (rank 0's): step, totals, sampler (epoch, global cursor), resumes."""
        return {"step": self.step, "train_time_s": self.train_time_s, "tokens": self.tokens,
                "sampler": self.sampler.state_dict() if self.sampler else None,
                "last": dict(self.last), "resumes": [dict(r) for r in self.resumes],
                **({"samples": self.samples.state_dict()} if self.samples is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.train_time_s, self.tokens = (state["step"], state["train_time_s"],
                                                     state["tokens"])
        if self.sampler and state.get("sampler"):
            saved, now = state["sampler"].get("dataset_len"), len(self.sampler.dataset)
            if saved is not None and saved != now:  # where the epoch stood means nothing now
                raise ConfigError(
                    f"the snapshot of step {self.step} was trained on {saved:,} samples and the "
                    f"data has {now:,} now: it changed since (a text edited or prepared again, "
                    "or --data another dataset), and the rest of the snapshot's epoch cannot be "
                    "told. Resume with the data it was trained on, or start afresh with "
                    "--no-resume or in another --run-dir")
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
        """This rank's part: its metrics window (by name)."""
        return {"window": asdict(self.window), "window_s": self.window_s,
                "window_steps": self.window_steps}

    def load_window_state(self, state: dict[str, Any]) -> None:
        saved = state["window"]  # a dict by name; a list (in field order) from older snapshots,
        if isinstance(saved, list):  # which end before the fields added since (zero there)
            saved = saved + [0.0] * (len(fields(WindowSums)) - len(saved))
        self._sums, self._pending = WindowSums.of(saved), {}
        self.window_s, self.window_steps = state["window_s"], state["window_steps"]

    def restart_window(self, window_sum: list[float], *, holder: bool) -> None:
        """After a resume on other ranks: the `holder` (rank 0) carries every old rank's sums."""
        self.window = WindowSums.of(list(window_sum)) if holder else WindowSums()
        self.window_s, self.window_steps = 0.0, 0
