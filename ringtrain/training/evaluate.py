"""Evaluation on the exact eval shard: every rank makes the same calls, none counts a sample twice.

    sums = eval_sums(strategy, eval_set, loss_fn, {"accuracy": exact_match}, batch_size=256,
                     autocast=nullcontext)
    # [loss_sum, count, accuracy_sum, accuracy_count] of this rank; the trainer reduces them

Which part a rank scores is the strategy's answer (`Strategy.eval_shard`): its data shard
(the default), all of it on one rank (a drifting strategy: no collective), or nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.utils.data import Dataset, default_collate

from ringtrain.data.sampler import DistributedSampler
from ringtrain.strategies.base import Strategy
from ringtrain.types import LossFn, MetricFn


def collate(dataset: Dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return default_collate([dataset[i] for i in indices])


def eval_sums(strategy: Strategy, eval_set: Dataset, loss_fn: LossFn, metrics: dict[str, MetricFn],
              batch_size: int, autocast: Callable[[], AbstractContextManager]) -> list[float]:
    """This rank's [loss_sum, count, (metric_sum, metric_count) per metric] on its eval shard.

    Every rank of the shard's layout makes the same number of `eval_logits` calls (a pipeline
    needs all stages); a rank whose exact shard is one sample shorter runs a placeholder batch
    and counts nothing.
    """
    sums = [0.0] * (2 + 2 * len(metrics))
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
        sums[0] += float(loss_fn(logits, y)) * len(chunk)
        sums[1] += len(chunk)
        for i, fn in enumerate(metrics.values()):
            sums[2 + 2 * i] += float(fn(logits, y).sum())
            sums[3 + 2 * i] += len(chunk)
    return sums
