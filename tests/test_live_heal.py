"""Heal from a live peer, in one process: two gloo ranks on threads, an in-memory store.

    .venv/bin/pytest -q tests/test_live_heal.py

`heal` sends the large tensors in place and the rest as a small pickled structure; the
receiver starts with other weights and an optimizer that has no state yet (as a fresh AdamW),
so every shape it needs comes from the source. After the heal both members' committed and live
states are equal, bit for bit, and the bytes reported are the state's.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.live import GlobalBatches, LiveState, WatchedGroup, heal, make_optimizer_state
from ringtrain.tensor_tree import INLINE_BYTES, fill_large, split_large


class _LazyMoments:
    """An optimizer whose state appears at its first step (as Adam's): a receiver that never
    stepped has no tensor to receive into."""

    def __init__(self, params):
        self.params, self.state = list(params), {}

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            m = self.state.setdefault(i, {"m": torch.zeros_like(p), "t": torch.tensor(0.0)})
            m["m"].mul_(0.9).add_(p.grad)
            m["t"] += 1
            p.sub_(0.1 * m["m"])

    def state_dict(self):
        return {"state": self.state}

    def load_state_dict(self, state):
        self.state = {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()}


def _member(rank: int, store: dist.Store, out: dict) -> None:
    torch.manual_seed(rank)  # different weights until healed
    model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Linear(100, 1))
    optimizer = _LazyMoments(model.parameters())
    state = LiveState(model, optimizer, GlobalBatches(64, 8))
    if rank == 0:  # two committed steps
        for _ in range(2):
            model(torch.randn(4, 200)).sum().backward()
            optimizer.step()
            state.step += 1
            state.commit()
    group = WatchedGroup(dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)),
                         lambda: None)
    out[rank] = (heal(state, group, rank, committed_step=-1 if rank == 1 else None), state)


def test_heal_sends_the_large_tensors_in_place_and_the_receiver_ends_equal():
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_member, args=(r, store, out)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(out) == {0, 1}, "a member raised or hung: see the thread's traceback above"
    (report0, source), (report1, receiver) = out[0], out[1]
    assert (report0.source, report0.step, report0.nbytes) == (0, 2, report1.nbytes)
    assert report1.source == 0 and report1.step == 2 and report1.seconds > 0
    assert receiver.step == receiver.committed_step == 2
    large = 100 * 200 * 4  # the first weight and its moment: the only tensors past INLINE_BYTES
    assert large >= INLINE_BYTES > 100 * 4
    assert 2 * large < report1.nbytes < 2 * large + 40_000  # plus the structure, RNG states
    in_place: list[torch.Tensor] = []
    structure = split_large(source.state_dict(), in_place)
    assert [t.shape for t in in_place] == [(100, 200), (100, 200)]  # the weight, its moment
    assert structure["model"]["0.weight"].device.type == "meta"
    assert structure["model"]["0.bias"].device.type == "cpu"  # small: pickled with the rest
    for live in (False, True):
        a = source.state_dict() if not live else {"model": source.model.state_dict(),
                                                   "optimizer": source.optimizer.state_dict()}
        b = receiver.state_dict() if not live else {"model": receiver.model.state_dict(),
                                                     "optimizer": receiver.optimizer.state_dict()}
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), k
        for i, s in a["optimizer"]["state"].items():
            for k, v in s.items():
                assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
    # The live optimizer state is not the commit's tensors: a step must not move the commit.
    first = receiver.optimizer.state_dict()["state"][0]["m"]
    assert first.data_ptr() != receiver.state_dict()["optimizer"]["state"][0]["m"].data_ptr()


def _heal_pair(receiver_steps: int, in_place: bool) -> tuple[LiveState, LiveState, dict]:
    """Rank 0 at step 2 heals rank 1 (a replacement if receiver_steps is -1, else a member
    with that many steps committed); returns both states and rank 1's tensors before the heal."""
    store, out, before = dist.HashStore(), {}, {}

    def member(rank: int) -> None:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Linear(100, 1))
        optimizer = _LazyMoments(model.parameters())
        state = LiveState(model, optimizer, GlobalBatches(64, 8), in_place=in_place)
        for _ in range(2 if rank == 0 else max(receiver_steps, 0)):
            model(torch.randn(4, 200)).sum().backward()
            optimizer.step()
            state.step += 1
            state.commit()
        if rank == 1:
            weight = state.state_dict()["model"]["0.weight"]
            before.update(param=model[0].weight, commit=weight, values=weight.clone())
        _heal_and_keep(state, store, rank, rank == 1 and receiver_steps < 0, out)

    return (*_run_pair(member, out), before)


def _heal_and_keep(state: LiveState, store: dist.Store, rank: int, fresh: bool,
                   out: dict) -> None:
    """Heal `state` as `rank` of a 2-rank group on `store` (a replacement if `fresh`); keep it."""
    group = WatchedGroup(dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)),
                         lambda: None)
    heal(state, group, rank, committed_step=-1 if fresh else None)
    out[rank] = state


def _run_pair(member, out: dict) -> tuple[LiveState, LiveState]:
    """`member(0)` and `member(1)` on two threads; the states they put in `out`."""
    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(out) == {0, 1}, "a member raised or hung: see the thread's traceback above"
    return out[0], out[1]


def test_a_replacement_receives_into_its_own_parameters_and_a_member_keeps_its_commit():
    # In place (ringtrain train --live's ddp): the parameters keep their memory (touched while
    # the replacement started) and hold the source's weights.
    source, replacement, before = _heal_pair(-1, in_place=True)
    weight = source.model[0].weight
    assert replacement.model[0].weight.data_ptr() == before["param"].data_ptr()
    assert torch.equal(replacement.model[0].weight, weight)
    # Copied commits: the replacement's commit copy is received into (before the change it
    # kept its own weights: new tensors were received into), and adopted.
    source, replacement, before = _heal_pair(-1, in_place=False)
    assert torch.equal(before["commit"], source.model[0].weight)
    assert torch.equal(replacement.model[0].weight, source.model[0].weight)
    # A member behind (its step 1 committed) receives into new tensors: its commit stays whole
    # through the heal, the newest state left if the source died half way.
    source, behind, before = _heal_pair(1, in_place=False)
    assert torch.equal(before["commit"], before["values"])
    assert not torch.equal(before["values"], source.model[0].weight)
    assert torch.equal(behind.model[0].weight, source.model[0].weight)
    assert behind.committed_step == 2


def test_fill_large_reuses_only_a_tensor_that_fits():
    skeleton = {"a": torch.empty(3, 4, device="meta"), "b": [torch.empty(2, device="meta")],
                "c": torch.empty(5, device="meta"), "d": torch.empty(6, device="meta"),
                "small": torch.ones(1)}
    mine = {"a": torch.zeros(3, 4), "b": [torch.zeros(2, dtype=torch.float64)],
            "c": torch.zeros(10)[::2], "d": torch.zeros(7)}
    large: list[torch.Tensor] = []
    filled = fill_large(skeleton, large, mine)
    assert filled["a"] is mine["a"]                     # same shape, dtype, contiguous
    assert filled["b"][0] is not mine["b"][0]           # another dtype
    assert filled["c"] is not mine["c"]                 # not contiguous
    assert filled["d"] is not mine["d"] and filled["d"].shape == (6,)  # another shape
    assert filled["small"] is skeleton["small"] and len(large) == 4
    assert [t.shape for t in fill_large(skeleton, [], None).values()
            if isinstance(t, torch.Tensor)][:1] == [(3, 4)]


def test_make_optimizer_state_moves_no_parameter_and_restores_lr():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    weights = [p.detach().clone() for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert make_optimizer_state(adamw)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert adamw.param_groups[0]["lr"] == 1e-2
    assert {k for s in adamw.state.values() for k in s} == {"step", "exp_avg", "exp_avg_sq"}
    assert not make_optimizer_state(adamw)  # it has state: left alone
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5)  # its step needs a closure
    assert not make_optimizer_state(lbfgs)
    assert lbfgs.param_groups[0]["lr"] == 0.5 and all(p.grad is None for p in model.parameters())


def _adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 200)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _moments(state: dict) -> list[torch.Tensor]:
    """An optimizer state dict's tensors, in order (a live one's, or a commit's)."""
    return [v for s in state["state"].values() for v in s.values()]


def _large(tensors: list[torch.Tensor]) -> list[int]:
    """The addresses of the tensors a heal broadcasts (the rest travel pickled: new ones)."""
    return [t.data_ptr() for t in tensors if t.nbytes >= INLINE_BYTES]


def _prepared_pair(in_place: bool) -> tuple[LiveState, LiveState, dict]:
    """Rank 0 (AdamW, step 2) heals rank 1, a replacement that ran `prepare_heal` first;
    returns both states and the addresses of the moments rank 1 made."""
    store, out, made = dist.HashStore(), {}, {}

    def member(rank: int) -> None:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Linear(100, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = LiveState(model, optimizer, GlobalBatches(64, 8), in_place=in_place)
        if rank == 0:
            for step in range(2):
                _adamw_step(model, optimizer, step)
                state.step += 1
                state.commit()
        else:
            state.prepare_heal()
            made["live"] = _large(_moments(optimizer.state_dict()))
            made["commit"] = _large(_moments(state.state_dict()["optimizer"]))
        _heal_and_keep(state, store, rank, rank == 1, out)

    return (*_run_pair(member, out), made)


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in_place"])
def test_a_prepared_replacement_heals_into_the_memory_it_made(in_place):
    """`prepare_heal` (LiveGroup.join, before a replacement's first beat) makes AdamW's state:
    the heal receives the source's moments into the commit's copies of it and loads them into
    the optimizer's own (no tensor placed inside the stall), and the next step is the source's."""
    source, replacement, made = _prepared_pair(in_place)
    live = _moments(replacement.optimizer.state_dict())
    committed = _moments(replacement.state_dict()["optimizer"])
    assert len(made["live"]) == 2  # the first weight's exp_avg, exp_avg_sq
    assert _large(live) == made["live"] and _large(committed) == made["commit"]
    if not in_place:  # a copy: the next step must not move the commit
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(live, committed, strict=True))
    for mine, theirs in zip(live, _moments(source.optimizer.state_dict()), strict=True):
        assert torch.equal(mine, theirs)
    for state in (source, replacement):
        _adamw_step(state.model, state.optimizer, 7)
    for a, b in zip(source.model.parameters(), replacement.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_restore_loads_a_torch_optimizers_commit_into_its_own_tensors():
    model = torch.nn.Linear(200, 100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _adamw_step(model, optimizer, 0)
    state = LiveState(model, optimizer, GlobalBatches(64, 8))
    own = [t.data_ptr() for t in _moments(optimizer.state_dict())]
    committed = [t.clone() for t in _moments(state.state_dict()["optimizer"])]
    _adamw_step(model, optimizer, 1)  # the step that fails half way
    state.restore()
    assert [t.data_ptr() for t in _moments(optimizer.state_dict())] == own
    for now, then in zip(_moments(optimizer.state_dict()), committed, strict=True):
        assert torch.equal(now, then)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(
        _moments(optimizer.state_dict()), _moments(state.state_dict()["optimizer"]), strict=True))
