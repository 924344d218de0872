"""The micro-batches a data rank trains on: its sampler's indices, collated, pinned on CUDA.

    batches = MicroBatches(train_set, sampler, batch_size=12, pin=device.type == "cuda")
    x, y = batches.next()

Every rank's shard has the same length, so every rank starts a new epoch at the same step; an
epoch's last partial batch is dropped (never a short batch on one rank only).

On CUDA a batch is page-locked (pinned): the strategy's `to(device, non_blocking=True)` is then
a copy the host does not wait for (from pageable memory CUDA stages it synchronously). No
prefetch thread is needed: a step that logs nothing never waits for the device, so the host
collates step n+1 while the GPU still runs step n. Reading the sampler a step ahead instead
would put its cursor (and `--record-samples`' log) past what a snapshot of step n must hold.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset

from ringtrain.data.sample_log import SampleLog
from ringtrain.data.sampler import DistributedSampler
from ringtrain.training.evaluate import collate


class MicroBatches:
    """This rank's training micro-batches in sampler order.

    Args:
        dataset: map-style dataset of (input, target) tensors.
        sampler: this rank's `DistributedSampler` (its epoch advances as it runs out).
        batch_size: samples per micro-batch.
        samples: records each batch's indices with its epoch (`--record-samples`), or None.
        pin: page-lock each batch (True on CUDA only: no CUDA call on a CPU path).
    """

    def __init__(self, dataset: Dataset, sampler: DistributedSampler, *, batch_size: int,
                 samples: SampleLog | None = None, pin: bool = False):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.samples, self.pin = samples, pin
        self._indices: Iterator[int] | None = None

    def restart(self, batch_size: int) -> None:
        """The sampler's cursor moved (a resume, maybe with another per-rank batch): a new
        iterator from there."""
        self._indices, self.batch_size = None, batch_size

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch of this rank's shard; a new epoch starts when one runs out."""
        indices: list[int] = []
        while len(indices) < self.batch_size:
            if self._indices is None:
                self._indices = iter(self.sampler)  # advances the epoch by itself
            try:
                indices.append(next(self._indices))
            except StopIteration:
                self._indices, indices = None, []
        if self.samples is not None:  # --record-samples: with the epoch it came from
            self.samples.add(self.sampler.epoch, indices)
        x, y = collate(self.dataset, indices)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y


def shard_sampler(train_set: Dataset, data_rank: int, data_world_size: int, *, batch_size: int,
                  seed: int) -> DistributedSampler:
    """This data rank's shuffled shard of `train_set`; ValueError where it holds less than one
    batch (every step needs one on every rank)."""
    sampler = DistributedSampler(train_set, num_replicas=data_world_size, rank=data_rank,
                                 shuffle=True, seed=seed)
    if len(sampler) < batch_size:
        raise ValueError(
            f"the training set has {len(train_set)} samples, {len(sampler)} per data rank over "
            f"{data_world_size} ranks: fewer than one batch of --batch-size {batch_size}; lower "
            "--batch-size or use more data")
    return sampler
