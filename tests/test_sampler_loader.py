"""`DistributedSampler.state_dict()` under a DataLoader counts what the loop was handed, not
what the loader's workers prefetched (ringtrain.torch_internals.data), so a resume sees every
sample once.

    .venv/bin/pytest -q tests/test_sampler_loader.py

One process; the loaders' workers are processes (so the fast tier skips these), children of
`ringtrain.testing`'s forkserver (torch imported once), not forks of pytest's process: after
earlier tests in the same pytest worker, a forked loader worker segfaulted once ("DataLoader
worker ... killed by signal: Segmentation fault", 1 run of the suite in about 20).
"""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data import BatchSampler
from torch.utils.data import DataLoader as TorchDataLoader

from ringtrain.data.sampler import DistributedSampler
from ringtrain.testing import worker_context

DATA = list(range(100))
# Out of the fast tier before the loader is made: refused inside DataLoader's iterator, a
# forkserver start leaves it half-built, and its __del__ raises (an unraisable warning).
WORKERS = pytest.mark.slow


def DataLoader(*args, num_workers: int = 0, **kwargs) -> TorchDataLoader:  # noqa: N802
    """torch's, its workers (if any) forkserver children."""
    context = worker_context() if num_workers else None
    return TorchDataLoader(*args, num_workers=num_workers, multiprocessing_context=context,
                           **kwargs)


def _sampler(rank: int = 0, replicas: int = 1) -> DistributedSampler:
    return DistributedSampler(DATA, num_replicas=replicas, rank=rank, seed=3)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=WORKERS)])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_resume_after_prefetching_workers_sees_every_sample_once(workers, replicas):
    used, states = [], []
    for rank in range(replicas):
        sampler = _sampler(rank, replicas)
        loader = iter(DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=workers))
        used += [x for _ in range(3) for x in next(loader).tolist()]
        states.append(sampler.state_dict())
        assert sampler._yielded >= 12  # drawn: 12 without workers, up to 28 with 2 workers
    assert all(s == states[0] for s in states)  # any rank's state resumes the whole job
    assert states[0]["samples_consumed"] == 12 * replicas
    rest = []
    for rank in range(replicas):
        resumed = _sampler(rank, replicas)
        resumed.load_state_dict(states[0])
        rest += list(resumed)
    assert sorted(used + rest) == DATA


@WORKERS
def test_the_last_short_batch_ends_the_epoch_and_the_next_iteration_starts_afresh():
    sampler = _sampler()
    batches = list(DataLoader(DATA, batch_size=8, sampler=sampler, num_workers=2))
    assert len(batches[-1]) == 4  # 100 = 12 x 8 + 4
    state = sampler.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)
    loader = iter(DataLoader(DATA, batch_size=8, sampler=sampler, num_workers=2))
    next(loader)
    assert sampler.state_dict()["samples_consumed"] == 8  # this epoch's loader, not the last


@WORKERS
def test_what_the_loader_cannot_say_falls_back_to_the_indices_drawn_or_consumed():
    class Pairs:  # a batch sampler of the user's own: its batches' sizes are its own
        def __init__(self, sampler):
            self.sampler = sampler

        def __iter__(self):
            it = iter(self.sampler)
            return iter(lambda: [next(it), next(it)], None)

        def __len__(self):
            return len(self.sampler) // 2

    sampler = _sampler()
    loader = iter(DataLoader(DATA, batch_sampler=Pairs(sampler), num_workers=2))
    next(loader)
    assert sampler.state_dict()["samples_consumed"] == sampler._yielded > 2
    assert sampler.state_dict(consumed=2)["samples_consumed"] == 2  # said by the caller
    torchs = _sampler()  # torch's own BatchSampler, given as batch_sampler=: read as batch_size
    loader = iter(DataLoader(DATA, batch_sampler=BatchSampler(torchs, 4, drop_last=False),
                             num_workers=2))
    next(loader)
    assert torchs.state_dict()["samples_consumed"] == 4 < torchs._yielded
    by_hand = _sampler()
    it = iter(by_hand)
    [next(it) for _ in range(5)]
    assert by_hand.state_dict()["samples_consumed"] == 5  # no DataLoader: what was drawn
    copy = pickle.loads(pickle.dumps(sampler))  # the loader's weakref is not carried
    assert copy._loader is None and copy.state_dict()["samples_consumed"] == sampler._yielded
