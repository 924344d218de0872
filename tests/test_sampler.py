"""DistributedSampler: torch's order, shards, epoch advance, resume, re-sharding, exact eval.

    .venv/bin/pytest -q tests/test_sampler.py

All single-process: `rank`/`num_replicas` are passed explicitly, as torch's tests do.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from ringtrain.data.sampler import DistributedSampler


def _ranks(n, world, **kw):
    return [DistributedSampler(range(n), num_replicas=world, rank=r, **kw) for r in range(world)]


def _take(sampler, k):
    """The first k indices of a fresh iteration (what a rank consumed before a snapshot)."""
    return list(itertools.islice(iter(sampler), k))


@pytest.mark.parametrize("n", [0, 1, 3, 10, 17, 64, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shuffle,drop_last",
                         [(True, False), (True, True), (False, False), (False, True)])
def test_same_indices_and_length_as_torch(n, world, shuffle, drop_last):
    for rank in range(world):
        ours = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=5,
                                  drop_last=drop_last)
        theirs = TorchSampler(range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
            assert len(ours) == len(theirs) == ours.num_samples == theirs.num_samples
        assert ours.total_size == theirs.total_size


@pytest.mark.parametrize("n,world", [(10, 2), (12, 4), (97, 8)])
def test_shards_disjoint_and_cover_when_divisible_or_exact(n, world):
    shards = [list(s) for s in _ranks(n, world, exact=True)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))  # disjoint and covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    if n % world == 0:  # nothing to pad or drop: every mode gives the same disjoint cover
        for kw, exact_kw in (({}, {}), ({"drop_last": True}, {}),
                             ({"shuffle": False}, {"shuffle": False})):
            assert [list(s) for s in _ranks(n, world, **kw)] == [
                list(s) for s in _ranks(n, world, exact=True, **exact_kw)]


def test_padding_and_drop_last_give_equal_lengths():
    for kw in ({}, {"drop_last": True}):
        lengths = {len(list(s)) for s in _ranks(10, 4, **kw)}
        assert len(lengths) == 1, kw  # every rank the same number of batches
    padded = Counter(i for s in _ranks(10, 4) for i in s)
    assert set(padded) == set(range(10)) and sum(padded.values()) == 12


def test_epoch_advances_by_itself_and_set_epoch_wins():
    s = DistributedSampler(range(50), num_replicas=2, rank=1, seed=3)
    t = TorchSampler(range(50), num_replicas=2, rank=1, seed=3)
    first, second = list(s), list(s)
    assert (len(first), len(second)) == (25, 25) and first != second
    assert s.epoch == 1
    assert second == (t.set_epoch(1) or list(t))
    _take(s, 3)  # an abandoned iteration still counts as epoch 2
    assert list(s) == (t.set_epoch(3) or list(t))
    s.set_epoch(0)
    assert list(s) == first  # explicit set_epoch wins...
    s.set_epoch(0)
    assert list(s) == first  # ...every time it is called
    assert list(s) == second  # and the advance resumes from there
    # `iter()` itself moves the epoch, not the first `next()`.
    s.set_epoch(7)
    it1, it2 = iter(s), iter(s)
    assert (s.epoch, next(it2)) == (8, (t.set_epoch(8) or list(t))[0])
    del it1


def test_dataloader_epochs_differ_without_set_epoch():
    s = DistributedSampler(range(40), num_replicas=2, rank=0)
    loader = DataLoader(list(range(40)), batch_size=5, sampler=s)
    a = torch.cat(list(loader)).tolist()
    b = torch.cat(list(loader)).tolist()
    t = TorchSampler(range(40), num_replicas=2, rank=0)
    t.set_epoch(1)
    assert a != b and b == list(t) and s.epoch == 1


@pytest.mark.parametrize("n,world,k", [(103, 4, 7), (100, 4, 24), (10, 3, 2), (64, 1, 63)])
@pytest.mark.parametrize("kw", [{}, {"drop_last": True}, {"exact": True}])
def test_mid_epoch_resume_yields_exactly_the_rest(n, world, k, kw):
    kw = {"seed": 11, **kw}
    for rank in range(world):
        full = list(DistributedSampler(range(n), world, rank, **kw).__iter__())
        live = DistributedSampler(range(n), world, rank, **kw)
        head = _take(live, min(k, len(full)))
        state = live.state_dict()
        json.dumps(state)  # plain ints/bools
        resumed = DistributedSampler(range(n), world, rank, **{**kw, "seed": 0})
        with pytest.warns(UserWarning, match="seed 0 replaced"):
            resumed.load_state_dict(state)
        assert len(resumed) == len(full) - len(head)
        assert head + list(resumed) == full
        nxt = DistributedSampler(range(n), world, rank, **kw)
        nxt.set_epoch(1)
        assert list(resumed) == list(nxt)  # then the next epoch, complete


def test_state_at_epoch_end_resumes_next_epoch():
    s = DistributedSampler(range(9), num_replicas=3, rank=0)
    it = iter(s)
    assert len(list(itertools.islice(it, 3))) == 3  # all taken, generator not yet exhausted
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["samples_consumed"] == 0
    fresh = DistributedSampler(range(9), num_replicas=3, rank=0)
    assert fresh.state_dict()["epoch"] == 0
    list(fresh)
    assert fresh.state_dict()["epoch"] == 1


def test_set_epoch_after_load_keeps_the_resume_position():
    s = DistributedSampler(range(30), num_replicas=2, rank=0)
    s.set_epoch(4)
    _take(s, 5)
    r = DistributedSampler(range(30), num_replicas=2, rank=0)
    r.load_state_dict(s.state_dict())
    r.set_epoch(4)  # the usual torch loop calls this on resume
    assert len(list(r)) == 10
    r.set_epoch(4)  # now a plain request for epoch 4, from its start
    assert len(list(r)) == 15


def _resplit(n, old_world, new_world, per_rank, old_kw, new_kw):
    """Consume `per_rank` on each old rank, resume on new ranks; return (seen_old, seen_new)."""
    old = _ranks(n, old_world, seed=9, **old_kw)
    seen_old = [i for s in old for i in _take(s, per_rank)]
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states)  # any rank's state resumes the job
    assert states[0]["samples_consumed"] == per_rank * old_world
    new = _ranks(n, new_world, seed=9, **new_kw)
    for s in new:
        s.load_state_dict(states[0])
    seen_new = [list(s) for s in new]
    return seen_old, seen_new


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 3), (3, 5), (4, 1)])
@pytest.mark.parametrize("n,per_rank", [(96, 5), (101, 7), (24, 5)])
def test_resplit_sees_every_sample_exactly_once(n, old_world, new_world, per_rank):
    seen_old, seen_new = _resplit(n, old_world, new_world, per_rank, {}, {"exact": True})
    assert Counter(seen_old + [i for s in seen_new for i in s]) == Counter(range(n))
    assert max(map(len, seen_new)) - min(map(len, seen_new)) <= 1


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 3)])
def test_resplit_with_padding_or_drop_last_keeps_ranks_equal(old_world, new_world):
    n, per_rank = 101, 7
    # Padding: each unseen sample goes to exactly one new rank, plus < new_world repeats.
    seen_old, seen_new = _resplit(n, old_world, new_world, per_rank, {}, {})
    assert len({len(s) for s in seen_new}) == 1
    rest = Counter(i for s in seen_new for i in s)
    unseen = set(range(n)) - set(seen_old)
    assert all(rest[i] == 1 for i in unseen)
    repeats = [i for i in rest if i not in unseen]  # padding: from the start of the epoch
    assert set(repeats) <= set(seen_old)
    assert sum(rest[i] for i in repeats) == -len(unseen) % new_world
    # drop_last: every sample at most once, fewer than new_world skipped.
    seen_old, seen_new = _resplit(n, old_world, new_world, per_rank, {}, {"drop_last": True})
    assert len({len(s) for s in seen_new}) == 1
    everything = Counter(seen_old + [i for s in seen_new for i in s])
    assert max(everything.values()) == 1 and n - len(everything) < new_world


def test_resplit_twice_4_to_2_to_3():
    n = 120
    old = _ranks(n, 4, exact=True)
    seen = [i for s in old for i in _take(s, 5)]
    mid = _ranks(n, 2, exact=True)
    for s in mid:
        s.load_state_dict(old[0].state_dict())
    seen += [i for s in mid for i in _take(s, 10)]
    assert mid[0].state_dict()["samples_consumed"] == 40
    last = _ranks(n, 3, exact=True)
    for s in last:
        s.load_state_dict(mid[1].state_dict())
    seen += [i for s in last for i in s]
    assert Counter(seen) == Counter(range(n))


def test_exact_mode_metrics_equal_single_process():
    values = torch.randn(103, dtype=torch.float64)
    for world in (2, 3, 4, 8):
        samplers = _ranks(103, world, shuffle=False, exact=True)
        assert [len(s) for s in samplers] == samplers[0].rank_lengths()
        # (sum, count) per rank, reduced once: exactly the single-process mean.
        parts = [(values[list(s)].sum(), len(s)) for s in samplers]
        total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        assert torch.allclose(total, values.mean(), rtol=0, atol=1e-12)
        assert max(len(s) for s in samplers) - min(len(s) for s in samplers) <= 1


def test_errors_carry_the_values():
    with pytest.raises(ValueError,
                       match=r"Invalid rank 5, rank should be in the interval \[0, 3\]"):
        DistributedSampler(range(8), num_replicas=4, rank=5)
    with pytest.raises(ValueError, match="Invalid rank -1"):
        DistributedSampler(range(8), num_replicas=4, rank=-1)
    with pytest.raises(ValueError, match="num_replicas=0"):
        DistributedSampler(range(8), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="exact=True and drop_last=True"):
        DistributedSampler(range(8), 2, 0, drop_last=True, exact=True)
    for seed in ("42", 1.5, True):  # failed later, in the first epoch's shuffle
        with pytest.raises(TypeError, match=rf"seed={seed!r}: an integer, the same on every"):
            DistributedSampler(range(8), 2, 0, seed=seed)
    state = DistributedSampler(range(8), 2, 0).state_dict()
    with pytest.raises(ValueError, match="dataset of 8 samples but this dataset has 9"):
        DistributedSampler(range(9), 2, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True but this sampler has shuffle=False"):
        DistributedSampler(range(8), 2, 0, shuffle=False).load_state_dict(state)


def test_defaults_come_from_the_process_group():
    from ringtrain.launch.process_group import destroy_distributed, init_distributed
    from ringtrain.runtime import DistributedInitError

    destroy_distributed()
    with pytest.raises(DistributedInitError, match="init_distributed"):
        DistributedSampler(range(8))
    init_distributed("gloo", rank=0, world_size=1)
    try:
        s = DistributedSampler(range(8))
        assert (s.rank, s.num_replicas) == (0, 1)
        with pytest.raises(ValueError, match="Invalid rank 1"):
            DistributedSampler(range(8), rank=1)
    finally:
        destroy_distributed()


def test_lazy_export():
    import ringtrain

    assert ringtrain.DistributedSampler is DistributedSampler


def test_resume_through_a_dataloader_and_with_prefetch():
    def make():
        s = DistributedSampler(range(60), num_replicas=2, rank=1, seed=4)
        return s, DataLoader(list(range(60)), batch_size=4, sampler=s)

    full = torch.cat(list(make()[1])).tolist()
    s, loader = make()
    it = iter(loader)
    head = torch.cat([next(it) for _ in range(3)]).tolist()  # num_workers=0 draws as it goes
    assert s.state_dict()["samples_consumed"] == 3 * 4 * 2
    r, loader2 = make()
    r.load_state_dict(s.state_dict())
    assert head + torch.cat(list(loader2)).tolist() == full
    # A loader with workers draws ahead of use: the caller says what was really consumed.
    p = DistributedSampler(range(60), num_replicas=2, rank=1, seed=4)
    _take(p, 20)
    assert p.state_dict(consumed=12) == s.state_dict()
    with pytest.raises(ValueError, match="consumed=31 but this iteration has 30 samples on rank 1"):
        p.state_dict(consumed=31)
