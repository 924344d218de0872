"""`DistributedSampler`: torch's sampler, plus resume, re-sharding, epoch advance and exact eval.

A drop-in for `torch.utils.data.distributed.DistributedSampler` (same arguments, defaults and,
for the same (seed, epoch, shuffle, drop_last), the same indices), that also

- advances its epoch by itself each time it is iterated again (`set_epoch` still wins);
- saves (seed, epoch, samples consumed) in `state_dict()`, so a resumed iteration yields exactly
  the indices that were not consumed yet, skipping by index arithmetic (no data is loaded);
- re-splits the rest of an epoch across a different number of ranks on resume;
- offers `exact=True` for evaluation: no padding, no dropping, ranks get n or n+1 samples.

    sampler = DistributedSampler(dataset, num_replicas=2, rank=0)   # or from the process group
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

Tests: `.venv/bin/pytest -q tests/test_sampler.py`.

How an epoch's indices are laid out (the "global order"): `base` is `randperm(N)` seeded with
`seed + epoch` (or `range(N)`). The iteration that starts at global cursor `c` takes `base[c:]`,
then pads it with `base[:pad]` (wrapping, like torch) or truncates it (`drop_last`) to a multiple
of `num_replicas`, or leaves it uneven (`exact`). Rank r takes every `num_replicas`-th index from
r. With c = 0 this is torch's layout exactly; with c a multiple of `num_replicas` it is exactly
the rest of torch's layout. A rank that consumed k samples has therefore advanced the global
cursor by k * num_replicas, which is what `state_dict()` records.
"""

from __future__ import annotations

import math
import numbers
import warnings
import weakref
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ringtrain.torch_internals import driving_loader, samples_handed_out

__all__ = ["DistributedSampler"]

# Where this sampler's current (or pending) iteration stands.
_PENDING, _RUNNING, _DONE = "pending", "running", "done"


class DistributedSampler(Sampler[int]):
    """Restrict data loading to a shard of the dataset; resumable and re-shardable.

    Args:
        dataset: a dataset with `__len__` (assumed constant size and order, as in torch).
        num_replicas: number of data shards; default: world size of the initialised process group.
        rank: this process's shard in [0, num_replicas); default: rank in the process group.
        shuffle: shuffle the indices, differently every epoch. Default True.
        seed: shuffle seed, identical on every rank. Default 0.
        drop_last: drop the tail so every rank gets the same number of samples, instead of
            padding with samples from the start of the epoch. Default False.
        exact: evaluation mode: neither pad nor drop, so each sample of the epoch is seen exactly
            once and ranks get n or n+1 samples (`rank_lengths()` tells how many each). Metrics
            reduced as (sum, count) then equal single-process ones exactly. Default False.

    .. warning::
        Epochs advance by themselves: every `iter(sampler)` after an iteration of epoch e has
        started (whether it ran to the end or was abandoned) uses epoch e + 1, unless
        `set_epoch` or `load_state_dict` was called since. So two `iter()` on the same sampler
        give two different epochs; to iterate the same epoch twice, call `set_epoch` before
        each. Iterate once per epoch on every rank, or the ranks' epochs drift apart.

    .. warning::
        Without `exact`, padding repeats up to num_replicas - 1 samples of the epoch and
        `drop_last` skips up to num_replicas - 1 of them, as in torch. When a state is resumed
        under another num_replicas, the unseen rest of the epoch is split afresh: every unseen
        sample goes to exactly one new rank, and the padding (or dropping) needed to give every
        new rank the same length is that of the new split, not of the old one.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        exact: bool = False,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"DistributedSampler needs a dataset with __len__ (map-style); got "
                            f"{type(dataset).__name__}; wrap an iterable in a list or a Dataset")
        if num_replicas is None or rank is None:
            from ringtrain.runtime import get_runtime  # raises a clear error before init

            runtime = get_runtime()
            num_replicas = runtime.world_size if num_replicas is None else num_replicas
            rank = runtime.rank if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: it must be at least 1")
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise TypeError(f"seed={seed!r}: an integer, the same on every rank (it seeds the "
                            "shuffle every rank draws its shard from)")
        if exact and drop_last:
            raise ValueError(
                "exact=True and drop_last=True contradict each other: exact mode neither pads "
                "nor drops; pass one of them"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.exact = exact
        self.epoch = 0
        # torch's attributes, for a full epoch: samples on this rank, and in the padded order.
        self.num_samples = self._rank_length(0, rank)
        self.total_size = self.num_samples * num_replicas if not exact else len(dataset)
        self._start = 0  # global cursor where the current/pending iteration of `epoch` starts
        self._yielded = 0  # samples this rank's current iteration has yielded
        self._phase = _PENDING
        # tells a stale iterator (superseded by a newer iter()) to stop counting
        self._generation = 0
        self._loader: tuple[int, weakref.ref] | None = None  # (generation, the DataLoader's)


    # ---- index arithmetic (pure) -------------------------------------------------------------

    def _span(self, start: int) -> int:
        """How many global positions an iteration starting at `start` covers (all ranks)."""
        n = len(self.dataset) - start
        if self.exact:
            return n
        if self.drop_last:
            return n // self.num_replicas * self.num_replicas
        return math.ceil(n / self.num_replicas) * self.num_replicas

    def _rank_length(self, start: int, rank: int) -> int:
        span = self._span(start)
        return max(0, span - rank + self.num_replicas - 1) // self.num_replicas

    def _indices(self, epoch: int, start: int) -> list[int]:
        """This rank's indices for an iteration of `epoch` starting at global cursor `start`."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)  # torch's seeding, so the orders match torch's
            base = torch.randperm(n, generator=g)
        else:
            base = torch.arange(n)
        rest = base[start:]
        span = self._span(start)
        if span > len(rest):  # pad by wrapping around the epoch's order, as torch does
            pad = span - len(rest)
            rest = torch.cat([rest, base.repeat(math.ceil(pad / n))[:pad]])
        return rest[: span][self.rank :: self.num_replicas].tolist()

    def rank_lengths(self) -> list[int]:
        """Samples each rank gets in the current (or next) iteration, indexed by rank.

        Equal on all ranks unless `exact=True`, where they differ by at most one; a loop that
        must run the same number of steps everywhere takes the max and lets shorter ranks
        contribute nothing to the last one.
        """
        start = self._start if self._phase != _DONE else 0
        return [self._rank_length(start, r) for r in range(self.num_replicas)]

    # ---- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        # Decided here, not lazily in a generator, so `iter()` itself moves the epoch on.
        if self._phase != _PENDING:
            self.epoch += 1
            self._start = 0
        self._phase = _RUNNING
        self._yielded = 0
        self._generation += 1
        # A DataLoader driving this iteration: its count of batches handed out, not the indices
        # its workers prefetched, is what the loop consumed (`state_dict`).
        loader = driving_loader()
        self._loader = (self._generation, weakref.ref(loader)) if loader is not None else None
        return self._iterate(self._indices(self.epoch, self._start), self._generation)

    def _iterate(self, indices: list[int], generation: int) -> Iterator[int]:
        for i in indices:
            if generation == self._generation:
                self._yielded += 1
            yield i
        if generation == self._generation:
            self._phase = _DONE

    def __len__(self) -> int:
        """Samples this rank yields in the current iteration, or the next one if it ran out.

        Shorter than `num_samples` only for an iteration resumed mid-epoch.
        """
        return self.rank_lengths()[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` for the next iteration (and stop the automatic advance for it).

        Setting the epoch a loaded state is about to resume keeps its position, so the usual
        `for epoch in ...: sampler.set_epoch(epoch)` loop resumes mid-epoch correctly.
        """
        if not (self._phase == _PENDING and epoch == self.epoch):
            self._start = 0
        self.epoch = epoch
        self._phase = _PENDING
        self._generation += 1

    # ---- state -------------------------------------------------------------------------------

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Seed, epoch and global samples consumed, as plain ints/bools (JSON-able).

        Args:
            consumed: samples this rank has consumed from the current iteration. Default: the
                samples in the batches the DataLoader iterating this sampler has handed out
                (with workers it draws indices ahead of use, and those are not counted), or,
                iterated without a DataLoader, how many indices its iterator yielded.

        .. warning::
            Call it at a step boundary where every rank has consumed the same number of
            samples: the global cursor is `consumed * num_replicas` past where the iteration
            started, so the states of all ranks are then equal and any of them resumes the
            whole job. A DataLoader of your own batch sampler, or with `in_order=False`,
            cannot say which indices it handed out: pass `consumed` there.
        """
        epoch, cursor = self.epoch, self._start
        if self._phase == _DONE:
            epoch, cursor = epoch + 1, 0
        elif self._phase == _RUNNING:
            taken = self._yielded if consumed is None else consumed
            if consumed is None and (handed := self._handed_out()) is not None:
                taken = min(taken, handed)
            length = self._rank_length(self._start, self.rank)
            if not 0 <= taken <= length:
                raise ValueError(
                    f"consumed={taken} but this iteration has {length} samples on rank "
                    f"{self.rank}; pass how many samples this rank took this epoch"
                )
            if taken == length:  # the epoch is over on this rank: resume with the next one
                epoch, cursor = epoch + 1, 0
            else:
                cursor = self._start + taken * self.num_replicas
        return {
            "seed": int(self.seed),
            "epoch": int(epoch),
            "samples_consumed": int(min(cursor, len(self.dataset))),
            "num_replicas": int(self.num_replicas),
            "dataset_len": int(len(self.dataset)),
            "shuffle": bool(self.shuffle),
        }

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle drops the loader's weakref
        return {**self.__dict__, "_loader": None}

    def _handed_out(self) -> int | None:
        """Samples in the batches the DataLoader driving this iteration has yielded (None: no
        DataLoader, or one whose count cannot be read)."""
        generation, ref = self._loader or (None, None)
        loader = ref() if ref is not None and generation == self._generation else None
        return samples_handed_out(loader, self) if loader is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields this rank's share of what `state` had not consumed.

        `state` may come from a sampler with another `num_replicas` (the rest of the epoch is
        re-split) or another `drop_last`/`exact`: this sampler's own settings apply to the rest.
        Its seed replaces this sampler's seed (with a warning if they differ), since the epoch
        in progress must keep its order.
        """
        n = len(self.dataset)
        missing = [k for k in ("dataset_len", "shuffle", "samples_consumed", "seed", "epoch")
                   if k not in state]
        if missing:
            raise ValueError(f"not a DistributedSampler state: keys {missing} missing (it has "
                             f"{sorted(state)}); pass what sampler.state_dict() returned")
        if state["dataset_len"] != n:
            raise ValueError(
                f"sampler state was saved for a dataset of {state['dataset_len']} samples but "
                f"this dataset has {n}; resume with the same dataset, or start afresh"
            )
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                f"sampler state was saved with shuffle={state['shuffle']} but this sampler has "
                f"shuffle={self.shuffle}; the epoch in progress cannot keep its order. Pass "
                f"shuffle={state['shuffle']}"
            )
        consumed = int(state["samples_consumed"])
        if not 0 <= consumed <= n:
            raise ValueError(f"samples_consumed={consumed} is outside [0, {n}] (dataset length)")
        if int(state["seed"]) != self.seed:
            warnings.warn(
                f"sampler seed {self.seed} replaced by the resumed state's seed {state['seed']}",
                stacklevel=2,
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._start = consumed
        if consumed and self._span(consumed) == 0:  # nothing left in that epoch
            self.epoch, self._start = self.epoch + 1, 0
        self._phase = _PENDING
        self._yielded = 0
        self._generation += 1
