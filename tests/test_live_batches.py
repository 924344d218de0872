"""In-process checks of the live layer's pure parts: each step's global batch, the shares, the
committed state. No process, no group.

    .venv/bin/pytest -q tests/test_live_batches.py
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from ringtrain.data.sampler import DistributedSampler
from ringtrain.live import GlobalBatches, LiveState


def test_fixed_world_shares_are_distributed_samplers_batches():
    # What the fault-free run trains: rank r's batch of step s under torch's layout.
    n, world, per_rank = 50, 3, 4
    batches = GlobalBatches(n, per_rank * world, seed=7)
    for epoch in range(2):
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=7,
                                         drop_last=True)
            sampler.set_epoch(epoch)
            mine = list(sampler)
            for i in range(batches.steps_per_epoch):
                step = epoch * batches.steps_per_epoch + i
                assert batches.share(step, rank, world) == mine[i * per_rank:(i + 1) * per_rank]


@pytest.mark.parametrize("members", [1, 2, 3, 5, 13])
def test_any_number_of_members_trains_each_sample_of_a_step_once(members):
    batches = GlobalBatches(40, 12, seed=1)
    for step in range(7):  # over an epoch boundary (3 steps per epoch)
        shares = [batches.share(step, r, members) for r in range(members)]
        counts = Counter(i for share in shares for i in share)
        assert sorted(counts) == sorted(batches.batch(step)) and set(counts.values()) == {1}
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # an epoch's steps are disjoint; the tail (40 - 3 * 12 samples) is dropped, as drop_last
    epoch0 = [i for s in range(3) for i in batches.batch(s)]
    assert len(set(epoch0)) == 36


def test_a_redo_trains_only_what_nobody_holds_and_a_spare_takes_the_lost_share():
    batches = GlobalBatches(48, 12, seed=3)
    step, world = 5, 4
    shares = [batches.share(step, r, world) for r in range(world)]
    # A spare (holding nothing) in lost rank 2's place: exactly rank 2's share, in its order.
    spare = [shares[0], shares[1], [], shares[3]]
    assert batches.redo_shares(step, spare) == [[], [], shares[2], []]
    # The survivors closing ranks: the lost share split over them, nothing else trained again.
    closed = batches.redo_shares(step, [shares[0], shares[1], shares[3]])
    assert sorted(i for part in closed for i in part) == sorted(shares[2])
    assert [len(part) for part in closed] == [1, 1, 1]
    # Two lost and one spare: more than a share for it alone, so everyone takes a part.
    split = batches.redo_shares(step, [shares[0], [], shares[3]])
    assert all(split) and sorted(i for part in split for i in part) == \
        sorted(shares[1] + shares[2])
    # Nobody holding anything (a regroup at a step boundary): the plain shares.
    assert batches.redo_shares(step, [[], [], []]) == [batches.share(step, r, 3) for r in range(3)]
    with pytest.raises(ValueError, match=r"held by one member only"):
        batches.redo_shares(step, [shares[0], shares[0]])
    with pytest.raises(ValueError, match=r"must be in the step's global batch"):
        batches.redo_shares(step, [[10_000]])


def test_errors_carry_the_values():
    with pytest.raises(ValueError, match="global_batch_size=20 with dataset_len=10"):
        GlobalBatches(10, 20)
    with pytest.raises(ValueError, match="Invalid rank 3"):
        GlobalBatches(10, 2).share(0, 3, 3)
    with pytest.raises(ValueError, match="start every member with the same"):
        GlobalBatches(10, 2).load_state_dict(GlobalBatches(10, 5).state_dict())


def _adam_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optimizer, LiveState(model, optimizer, GlobalBatches(8, 4))


def _train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_restore_goes_back_to_the_commit_and_stepping_after_it_leaves_the_commit_alone():
    model, optimizer, state = _adam_state()
    _train(model, optimizer, 2)
    state.step = 2
    state.commit()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    for _ in range(2):  # restore twice: the optimizer must not have stepped the commit itself
        _train(model, optimizer, 1)
        torch.rand(1)
        state.step = 3
        state.restore()
        assert state.step == 2
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
        restored = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(restored, moments, strict=True))
    first = torch.rand(1)
    state.restore()
    assert torch.equal(torch.rand(1), first)  # the RNG came back too


def test_a_state_loaded_from_a_peer_continues_as_the_peer_does():
    model, optimizer, state = _adam_state()
    _train(model, optimizer, 3)
    state.step = 3
    state.commit()
    peer_model, peer_optimizer, peer = _adam_state()  # a replacement: fresh Adam, no moments
    peer.load_state_dict(state.state_dict())
    _train(model, optimizer, 2)
    _train(peer_model, peer_optimizer, 2)
    assert peer.step == 3
    pairs = zip(model.parameters(), peer_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("in_place", [False, True])
def test_commits_in_place_or_copied_train_the_same_and_restore_alike(in_place):
    # A step that fails before the optimizer steps (as ddp's all-reduce does) is restored;
    # in place the commit is the live tensors, copied it is a copy: the same run either way.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = LiveState(model, optimizer, GlobalBatches(8, 4), in_place=in_place)
    ref_model = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(ref_model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.full((3, 4), float(step))).sum().backward()  # the step fails here
        first = torch.rand(1)
        state.restore()
        assert torch.equal(torch.rand(1), first) and model.weight.grad is None
        _train(model, optimizer, 1)
        _train(ref_model, ref_optimizer, 1)
        state.step = step + 1
        state.commit()
        committed = state.state_dict()
        live = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
        held = [s["exp_avg"] for s in committed["optimizer"]["state"].values()]
        assert all((a is b) == in_place and torch.equal(a, b)
                   for a, b in zip(held, live, strict=True))
        assert all((t.data_ptr() == model.state_dict()[k].data_ptr()) == in_place
                   for k, t in committed["model"].items())
    pairs = zip(model.parameters(), ref_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # bit for bit


def test_a_state_healed_in_place_commits_the_tensors_it_was_given():
    model, optimizer, state = _adam_state()
    _train(model, optimizer, 3)
    state.step = 3
    state.commit()
    torch.manual_seed(1)
    peer_model = torch.nn.Linear(4, 2)
    peer_optimizer = torch.optim.Adam(peer_model.parameters(), lr=0.1)
    peer = LiveState(peer_model, peer_optimizer, GlobalBatches(8, 4), in_place=True)
    given = copy.deepcopy(state.state_dict())  # what a heal receives: nothing else holds it
    peer.load_state_dict(given, adopt=True)
    moments = [s["exp_avg"] for s in given["optimizer"]["state"].values()]
    assert all(peer_optimizer.state[p]["exp_avg"] is m  # taken, not copied again
               for p, m in zip(peer_model.parameters(), moments, strict=True))
    assert all(t.data_ptr() == peer_model.state_dict()[k].data_ptr()
               for k, t in peer.state_dict()["model"].items())
    _train(model, optimizer, 2)
    _train(peer_model, peer_optimizer, 2)
    pairs = zip(model.parameters(), peer_model.parameters(), strict=True)
    assert peer.step == 3 and all(torch.equal(a, b) for a, b in pairs)


def test_a_commit_fills_the_previous_commits_tensors_and_equals_a_deep_copy():
    from ringtrain.live.state import copy_reusing

    model, optimizer, state = _adam_state()
    _train(model, optimizer, 1)
    state.step = 1
    state.commit()  # the first with moments: they are new, so copied as deepcopy does
    before = [t.data_ptr() for t in state.state_dict()["model"].values()]
    moments = [s["exp_avg"].data_ptr() for s in state.state_dict()["optimizer"]["state"].values()]
    _train(model, optimizer, 2)
    state.step = 3
    state.commit()
    committed = state.state_dict()
    assert [t.data_ptr() for t in committed["model"].values()] == before  # filled, not new
    assert [s["exp_avg"].data_ptr() for s in committed["optimizer"]["state"].values()] == moments
    reference = copy.deepcopy(optimizer.state_dict())
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(
        committed["optimizer"]["state"].values(), reference["state"].values(), strict=True))
    assert all(torch.equal(committed["model"][k], v) for k, v in model.state_dict().items())
    assert committed["optimizer"]["param_groups"] == reference["param_groups"]
    # Tied tensors stay one copy (deepcopy's memo); a changed shape gets a new tensor.
    tied = torch.ones(3)
    out = copy_reusing({"a": tied, "b": tied, "c": torch.ones(2)}, {"c": torch.zeros(5)})
    assert out["a"] is out["b"] and out["a"] is not tied and out["c"].shape == (2,)
