"""A step redone after a fault trains only what nobody holds (`ReplicaLiveHooks`, in-process).

    .venv/bin/pytest -q tests/test_live_redo.py

A member keeps its summands (its weighted gradients, `LiveHooks.contribution`) through a failed
all-reduce; the redo adds the samples nobody held. Checked against the step trained whole on one
process: the same weights within 1e-6 when the held part and the new part were computed apart
(the reduction order differs), and bit for bit when nothing new is added (a member whose share
was all held: with a spare in a lost member's place, every survivor's case). No process: a gloo
group of one on a HashStore, and a group whose all-reduce fails as a dead peer's does.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.live import GlobalBatches, LiveState
from ringtrain.strategies.live_step import LiveStepError, ReplicaLiveHooks
from ringtrain.trace import NO_TRACE

B = 12


class _DeadPeer:
    def allreduce(self, tensors):
        raise RuntimeError("Connection reset by peer")  # what gloo says when a peer died


def _hooks(model: nn.Module) -> ReplicaLiveHooks:
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    runtime = SimpleNamespace(device=torch.device("cpu"), process_group=group)
    strategy = SimpleNamespace(module=model, loss_fn=nn.functional.mse_loss, runtime=runtime,
                               tracer=NO_TRACE,
                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    return ReplicaLiveHooks(strategy)


def _micro(x: torch.Tensor, y: torch.Tensor, ids: list[int]) -> list[tuple[torch.Tensor,
                                                                           torch.Tensor]]:
    half = len(ids) // 2  # two micro-batches: accumulation inside each part too
    return [(x[ids[:half]], y[ids[:half]]), (x[ids[half:]], y[ids[half:]])]


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(B, 6), torch.randn(B, 3)
    whole = _hooks(copy.deepcopy(model))
    result = whole.train_step(_micro(x, y, list(range(B))), lr=1e-2, grad_clip=1.0, weight=1.0)
    return model, x, y, whole.model, result


def _failed_then_redone(model, x, y, held_ids: list[int]):
    hooks = _hooks(copy.deepcopy(model))
    runtime = hooks.strategy.runtime
    group, runtime.process_group = runtime.process_group, _DeadPeer()
    with pytest.raises(RuntimeError, match="reset by peer"):
        hooks.train_step(_micro(x, y, held_ids), lr=1e-2, grad_clip=1.0,
                         weight=len(held_ids) / B)
    held = hooks.contribution()
    assert held is not None and held.count == len(held_ids)
    hooks.model.zero_grad(set_to_none=True)  # what `LiveState.restore` does
    runtime.process_group = group
    rest = [i for i in range(B) if i not in held_ids]
    result = hooks.train_step(_micro(x, y, rest) if rest else [], lr=1e-2, grad_clip=1.0,
                              weight=len(rest) / B, held=held)
    return hooks.model, result


def test_a_redo_adds_the_samples_nobody_held_to_what_was_held(setup):
    model, x, y, reference, whole = setup
    redone, result = _failed_then_redone(model, x, y, held_ids=[0, 2, 3, 5, 7, 8, 9, 11])
    assert result.count == whole.count == B
    assert float(result.loss_sum) == pytest.approx(float(whole.loss_sum), rel=1e-6)
    for a, b in zip(redone.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    moved = next(iter(model.parameters()))
    assert not torch.equal(next(iter(redone.parameters())), moved)  # it stepped


def test_a_member_whose_share_was_all_held_sends_the_same_sums_bit_for_bit(setup):
    model, x, y, reference, whole = setup
    redone, result = _failed_then_redone(model, x, y, held_ids=list(range(B)))
    assert result.count == B and torch.equal(result.loss_sum, whole.loss_sum)
    for a, b in zip(redone.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_ids_gathered_round_trip_and_too_many_are_refused_with_the_values():
    from ringtrain.live import gather_ids

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    assert gather_ids(group, [5, 1, 9], B) == [[5, 1, 9]]
    assert gather_ids(group, [], B) == [[]]
    with pytest.raises(ValueError, match=r"13 ids .* at most 12"):
        gather_ids(group, list(range(B + 1)), B)


def test_ddp_commits_in_place_a_failed_all_reduce_restores_nothing_and_an_optimizer_error_ends(
        setup):
    # The commit holds the live tensors (`commits_in_place`): the all-reduce fails before the
    # optimizer steps, so restoring loads nothing and the redo is the whole step bit for bit.
    model, x, y, whole_model, _ = setup
    hooks = _hooks(copy.deepcopy(model))
    assert hooks.commits_in_place
    state = LiveState(hooks.model, hooks.optimizer, GlobalBatches(B, B), in_place=True)
    weights = [p.data_ptr() for p in hooks.model.parameters()]
    assert [t.data_ptr() for t in state.state_dict()["model"].values()] == weights
    before = copy.deepcopy(hooks.model.state_dict())
    runtime = hooks.strategy.runtime
    group, runtime.process_group = runtime.process_group, _DeadPeer()
    with pytest.raises(RuntimeError, match="reset by peer"):
        hooks.train_step(_micro(x, y, list(range(B))), lr=1e-2, grad_clip=1.0, weight=1.0)
    state.restore()
    assert all(torch.equal(v, before[k]) for k, v in hooks.model.state_dict().items())
    assert all(p.grad is None for p in hooks.model.parameters())
    runtime.process_group = group
    hooks.train_step(_micro(x, y, list(range(B))), lr=1e-2, grad_clip=1.0, weight=1.0)
    pairs = zip(hooks.model.parameters(), whole_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    state.step = 1
    state.commit()
    # After the all-reduce the optimizer changes what the commit holds: an error there is not
    # a lost peer, and redoing the step from half a step on would be wrong: not recovered.
    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")
    hooks.optimizer.step = fails
    with pytest.raises(LiveStepError, match="out of memory") as caught:
        hooks.train_step(_micro(x, y, list(range(B))), lr=1e-2, grad_clip=1.0, weight=1.0)
    assert not isinstance(caught.value, RuntimeError)  # the live loop recovers RuntimeErrors
