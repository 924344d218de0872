"""Evaluation on the exact eval shard: every rank makes the same calls, none counts a sample twice.

    sums = eval_sums(strategy, eval_set, loss_fn, {"accuracy": exact_match}, batch_size=256,
                     autocast=nullcontext)
    sums.loss_sum, sums.count, sums.metrics["accuracy"]   # this rank's; the trainer reduces them

Which part a rank scores is the strategy's answer (`Strategy.eval_shard`): its data shard
(the default), all of it on one rank (a drifting strategy: no collective), or nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset, default_collate

from ringtrain.data.sampler import DistributedSampler
from ringtrain.strategies.base import Strategy
from ringtrain.types import LossFn, MetricFn


def collate(dataset: Dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples at `indices` as one (inputs, targets) batch; a TypeError naming the form
    of the dataset's samples where they are not (input, target) pairs (a dict of fields
    unpacked to its keys: "'str' object has no attribute 'to'" in the step)."""
    batch = default_collate([dataset[i] for i in indices])
    if isinstance(batch, tuple | list) and len(batch) == 2 and \
            all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    sample = dataset[indices[0]]
    form = (f"a dict with keys {sorted(sample)}" if isinstance(sample, dict) else
            f"a {type(sample).__name__} of {len(sample)}" if isinstance(sample, tuple | list)
            else f"a {type(sample).__name__}")
    raise TypeError(f"{type(dataset).__name__}[{indices[0]}] is {form}: the Trainer takes a "
                    "Dataset of (input, target) pairs, tensors or numbers (the model gets the "
                    "input, loss_fn(output, target) the target); return them from __getitem__, "
                    "e.g. return d['x'], d['y']")


@dataclass
class EvalSums:
    """One rank's evaluation sums, by name: the loss and each metric as (sum, count).

    Summed over ranks as one flat list (`flat`: loss_sum, count, then each metric's sum and
    count in the metrics' order, the trainer's `eval_metrics`, the same on every rank).
    """

    loss_sum: float = 0.0
    count: float = 0.0
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def flat(self) -> list[float]:
        return [self.loss_sum, self.count, *(v for pair in self.metrics.values() for v in pair)]

    @classmethod
    def of(cls, values: list[float], names: list[str]) -> EvalSums:
        """From `flat()`'s list (a sum over ranks), the metrics named in `flat`'s order."""
        if len(values) != 2 + 2 * len(names):
            raise ValueError(f"{len(values)} eval sums for the metrics {names}: expected "
                             f"{2 + 2 * len(names)}")
        return cls(values[0], values[1], {name: list(values[2 + 2 * i:4 + 2 * i])
                                          for i, name in enumerate(names)})

    def means(self) -> dict[str, float]:
        """{"eval_loss": ..., "eval_<metric>": ...}; nan where nothing was counted."""
        def mean(total: float, count: float) -> float:
            return total / count if count else float("nan")
        return {"eval_loss": mean(self.loss_sum, self.count),
                **{f"eval_{name}": mean(*pair) for name, pair in self.metrics.items()}}


def checked_eval_set(eval_set: Dataset | None) -> Dataset | None:
    """`eval_set`, or a ValueError where it holds no sample: its mean loss would be 0/0, a NaN
    logged as the held-out loss at every evaluation, and no metric."""
    if eval_set is not None and len(eval_set) == 0:  # type: ignore[arg-type]
        raise ValueError(f"the evaluation set ({type(eval_set).__name__}) holds no sample; give "
                         "one with samples in it, or eval_set=None to train without evaluating")
    return eval_set


def eval_sums(strategy: Strategy, eval_set: Dataset, loss_fn: LossFn, metrics: dict[str, MetricFn],
              batch_size: int, autocast: Callable[[], AbstractContextManager]) -> EvalSums:
    """This rank's loss and metric sums on its eval shard.

    Every rank of the shard's layout makes the same number of `eval_logits` calls (a pipeline
    needs all stages); a rank whose exact shard is one sample shorter runs a placeholder batch
    and counts nothing.
    """
    sums = EvalSums(metrics={name: [0.0, 0.0] for name in metrics})
    shard = strategy.eval_shard()
    if shard is None:  # this rank takes no part (e.g. a drifting replica: rank 0 scores all)
        return sums
    indices: list[int] = []
    if shard.index is not None:
        sampler = DistributedSampler(eval_set, num_replicas=shard.count, rank=shard.index,
                                     shuffle=False, exact=True)
        indices = list(sampler)
    longest = math.ceil(len(eval_set) / shard.count)  # exact mode: n or n + 1
    for b in range(math.ceil(longest / batch_size)):
        chunk = indices[b * batch_size:(b + 1) * batch_size]
        x, y = collate(eval_set, chunk or [0])
        with autocast():
            logits = strategy.eval_logits(x)
        if logits is None or not chunk:
            continue
        y = y.to(logits.device)
        sums.loss_sum += float(loss_fn(logits, y)) * len(chunk)
        sums.count += len(chunk)
        for name, fn in metrics.items():
            sums.metrics[name][0] += per_sample_sum(name, fn(logits, y), len(chunk))
            sums.metrics[name][1] += len(chunk)
    return sums


def per_sample_sum(name: str, values: object, n: int) -> float:
    """The sum of a metric's values for a batch of `n`; a ValueError for anything but one value
    per sample: a batch's mean (or a (value, count) pair) summed as if it were one sample's
    would give a wrong figure without a word."""
    if not isinstance(values, torch.Tensor) or values.shape != (n,):
        got = (f"a tensor of shape {tuple(values.shape)}" if isinstance(values, torch.Tensor)
               else f"a {type(values).__name__}")
        raise ValueError(
            f"eval_metrics[{name!r}] returned {got} for a batch of {n}: a metric returns one "
            f"value per sample, shape ({n},), which the trainer sums and counts over every rank "
            "(a mean of means would depend on the batch and rank count); e.g. "
            "lambda logits, y: (logits.argmax(-1) == y).float()")
    return float(values.sum())
