"""Exactly-once data, recorded: which global sample indices each optimizer step consumed.

    ringtrain train --record-samples --run-dir runs/a ...     # the history rides in every snapshot
    history = SampleLog.from_state(torch.load("runs/a/snapshots/snap-00000100/shared.pt")
                                   ["trainer"]["samples"])
    report = check_history(history, dataset_len=9500, seed=1337, global_batch=128)

Off by default (`TrainerConfig.record_samples`). Each rank notes the indices of every
micro-batch it draws, with the sampler's epoch (`add`), and closes the step (`end_step`).
Before every snapshot the ranks exchange what they noted since the last one through the
strategy's agreement (`sync`: one `gather` of a JSON text), so every rank holds the whole job's
history and rank 0 writes it into `shared.pt` with the loop's state: it is committed
atomically with the snapshot. On resume the history is the snapshot's, the committed prefix;
the steps trained after that snapshot and lost to a crash are trained again and recorded
again. So the committed history of a finished run says what its weights were trained on,
whatever happened on the way (restarts, another number of ranks); it is complete when the last
step is a snapshot step (--steps a multiple of --snapshot-every), as the final snapshot holds it.

`check_history` (pure) proves it: the steps are 1..S with none missing or doubled, each step
holds one global batch, and within each epoch the steps take consecutive positions of that
epoch's order (`randperm(N)` seeded with seed + epoch, as `DistributedSampler`): no index
skipped or repeated; an epoch's dropped tail (the partial last batch) is shorter than a batch.
Tests: `.venv/bin/pytest -q tests/test_chaos.py -k history`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SampleLog", "check_history", "epoch_order"]


class SampleLog:
    """One rank's record of the sample indices of each step, and the job's merged history.

    Args:
        data_rank: this rank's data shard (None: it reads no data). Ranks with the same data
            rank (pipeline stages of one replica) read the same indices: merged once.
    """

    def __init__(self, data_rank: int | None = None):
        self.data_rank = data_rank
        self.steps: list[int] = []  # merged history: step numbers, ascending
        self.entries: list[list[tuple[int, list[int]]]] = []  # per step: (epoch, indices) pieces
        self._open: list[tuple[int, list[int]]] = []  # this rank, the step in progress
        self._pending: dict[int, list[tuple[int, list[int]]]] = {}  # this rank, since the last sync

    # -- recording (every rank) --------------------------------------------------------------
    def add(self, epoch: int, indices: list[int]) -> None:
        """One micro-batch this rank drew from epoch `epoch`."""
        self._open.append((int(epoch), [int(i) for i in indices]))

    def end_step(self, step: int) -> None:
        """Step `step` is done: what was drawn since the last call belongs to it."""
        self._pending[int(step)] = self._open
        self._open = []

    def sync(self, gather: Callable[[str], dict[int, str]]) -> None:
        """Merge every rank's pending steps into the history (collective: every rank calls it
        at the same step, e.g. before a snapshot). `gather` is the agreement's."""
        mine = json.dumps({"data_rank": self.data_rank,
                           "steps": {str(s): e for s, e in self._pending.items()}})
        self._pending = {}
        merged: dict[int, list[tuple[int, list[int]]]] = {}
        seen: set[int] = set()
        for _, text in sorted(gather(mine).items()):
            got = json.loads(text)
            if got["data_rank"] is None or got["data_rank"] in seen:
                continue  # reads no data, or another stage of a replica already counted
            seen.add(got["data_rank"])
            for s, pieces in got["steps"].items():
                merged.setdefault(int(s), []).extend((int(e), list(ix)) for e, ix in pieces)
        for s in sorted(merged):
            if self.steps and s <= self.steps[-1]:
                raise RuntimeError(f"sample history: step {s} recorded after step {self.steps[-1]}")
            self.steps.append(s)
            self.entries.append(merged[s])

    # -- snapshots (compact: flat int tensors) -------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The merged history as flat tensors: step numbers, and per piece its step position,
        epoch and length; all indices concatenated."""
        where, epochs, lengths, flat = [], [], [], []
        for pos, pieces in enumerate(self.entries):
            for e, ix in pieces:
                where.append(pos)
                epochs.append(e)
                lengths.append(len(ix))
                flat.extend(ix)
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return {"steps": as_t(self.steps), "piece_step": as_t(where), "piece_epoch": as_t(epochs),
                "piece_len": as_t(lengths), "indices": as_t(flat)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The committed history; what this rank noted since is dropped (it is trained again)."""
        self.steps = state["steps"].tolist()
        self.entries = [[] for _ in self.steps]
        flat, at = state["indices"].tolist(), 0
        for pos, e, n in zip(state["piece_step"].tolist(), state["piece_epoch"].tolist(),
                             state["piece_len"].tolist(), strict=True):
            self.entries[pos].append((e, flat[at:at + n]))
            at += n
        self._open, self._pending = [], {}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> SampleLog:
        log = cls()
        log.load_state_dict(state)
        return log

    def step_sets(self) -> dict[int, list[tuple[int, int]]]:
        """step -> sorted (epoch, index) pairs: for comparing two runs step by step."""
        return {s: sorted((e, i) for e, ix in pieces for i in ix)
                for s, pieces in zip(self.steps, self.entries, strict=True)}


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of `epoch`, as `DistributedSampler` lays it out."""
    if not shuffle:
        return list(range(dataset_len))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=g).tolist()


def check_history(log: SampleLog, *, dataset_len: int, seed: int, global_batch: int,
                  steps: int | None = None, shuffle: bool = True) -> dict[str, Any]:
    """Check that `log` is exactly the epochs' orders, consumed once; returns the figures.

    Returns a dict: `steps`, `samples`, `epochs`, `skipped` (indices of an epoch's consumed
    prefix that no step took), `repeated` (indices taken twice in one epoch), `out_of_order`
    (steps whose indices are not the next positions of their epoch's order), `missing_steps`,
    `wrong_batch` (steps without one global batch), `tail_dropped` (per finished epoch: the
    partial last batch, by design) and `errors` (readable lines; empty means exactly once).
    """
    errors: list[str] = []
    expect = list(range(1, (steps if steps is not None
                            else (log.steps[-1] if log.steps else 0)) + 1))
    missing = sorted(set(expect) - set(log.steps))
    doubled = len(log.steps) - len(set(log.steps))
    if missing:
        errors.append(f"steps missing from the history: {missing[:10]}")
    if doubled:
        errors.append(f"{doubled} steps recorded twice")
    wrong_batch = [s for s, p in zip(log.steps, log.entries, strict=True)
                   if sum(len(ix) for _, ix in p) != global_batch]
    if wrong_batch:
        errors.append(f"steps without one global batch of {global_batch}: {wrong_batch[:10]}")
    orders: dict[int, list[int]] = {}
    cursor: dict[int, int] = {}  # epoch -> positions consumed so far
    taken: dict[int, set[int]] = {}
    skipped = repeated = 0
    out_of_order: list[int] = []
    for s, pieces in zip(log.steps, log.entries, strict=True):
        by_epoch: dict[int, list[int]] = {}
        for e, ix in pieces:
            by_epoch.setdefault(e, []).extend(ix)
        for e, ix in sorted(by_epoch.items()):
            if e not in orders:
                orders[e] = epoch_order(dataset_len, seed, e, shuffle)
                cursor[e], taken[e] = 0, set()
            order, p = orders[e], cursor[e]
            want = order[p:p + len(ix)]
            if sorted(ix) != sorted(want):
                out_of_order.append(s)
            repeated += len(ix) - len(set(ix)) + len(set(ix) & taken[e])
            taken[e] |= set(ix)
            cursor[e] = p + len(ix)
    for e, order in orders.items():
        skipped += len(set(order[:cursor[e]]) - taken[e])
    if out_of_order:
        errors.append(f"steps not taking the next positions of their epoch's order: "
                      f"{out_of_order[:10]}")

    if repeated:
        errors.append(f"{repeated} indices taken twice within an epoch")
    if skipped:
        errors.append(f"{skipped} indices of an epoch's consumed part never taken")
    epochs = sorted(orders)
    if epochs and epochs != list(range(epochs[0], epochs[-1] + 1)):
        errors.append(f"epochs not consecutive: {epochs}")
    tails = {e: dataset_len - cursor[e] for e in epochs[:-1]}
    long_tails = {e: t for e, t in tails.items() if t >= global_batch}
    if long_tails:
        errors.append(f"epochs ended with a whole batch or more left (skipped): {long_tails}")
    return {"steps": len(log.steps), "samples": sum(len(ix) for p in log.entries for _, ix in p),
            "epochs": len(epochs), "skipped": skipped + sum(long_tails.values()),
            "repeated": repeated, "out_of_order": len(out_of_order), "missing_steps": len(missing),
            "wrong_batch": len(wrong_batch), "tail_dropped": tails, "errors": errors}
