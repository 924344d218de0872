"""Live ZeRO's redundancy and re-shard, without processes (gloo, CPU, a group of one).

    .venv/bin/pytest -q tests/test_zero_live.py

The plan (`ringtrain.zero.live`: buddies, who sends which part, a double loss named), and the
re-shard itself: a state of 3 ranks, with rank 1's own part lost and its buddy's copy (moments
only, parameters from the replicated model) standing in, loads into a fresh ZeRO wrapper as
the state it was cut from, bit for bit. The same parts as one rank's part (a live snapshot)
equal it too. Stage 3 (the parameter shards in the parts): `ZeroLiveHooks`' own re-shard of
3 parts onto one member, and of one member's onto two (a replacement with other weights and
nothing held; two gloo ranks on threads, an in-memory store). `LiveHooks` bookkeeping of
`ZeroLiveHooks`: which commit's parts a member keeps over a restore and a heal. The step over
real members: tests/test_live_zero.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import Runtime
from ringtrain.strategies.zero import ZeroStrategy
from ringtrain.strategies.zero_live import Held, one_rank_part
from ringtrain.training.config import adamw
from ringtrain.zero import reshard
from ringtrain.zero.live import (
    ZeroShardsLostError,
    buddy_offset,
    buddy_part,
    moments_only,
    rebuild_plan,
    with_params,
)

MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=1, n_head=2, n_embd=32)
CPU = torch.device("cpu")


def test_a_buddy_is_a_host_away_where_the_members_span_hosts():
    assert buddy_offset(1, 1) == 0  # alone: no copy
    assert [buddy_offset(w, 1) for w in (2, 3, 4)] == [1, 1, 1]
    assert buddy_offset(4, 2) == 2  # ranks 0, 1 on host A: copies on host B and back
    assert buddy_offset(3, 3) == 1 and buddy_offset(2, 4) == 1  # one host: the next rank
    assert buddy_offset(6, 3) == 3


def test_the_plan_moves_only_what_a_member_lacks_and_names_a_double_loss():
    numels = [10, 7]
    # 3 members held a layout of 3 (own + the copy of rank - 1); member 1 is a replacement.
    held = [[0, 2], [], [2, 1]]
    needs, moves = rebuild_plan(held, 3, numels, 3, step=5)
    assert needs == [[0], [1], [2]]
    assert moves == [(1, 2, 1)]  # rank 1's part from the member holding its copy
    # Closing ranks (3 -> 2): the survivors load two saved ranks' parts each.
    needs, moves = rebuild_plan([[0, 2], [2, 1]], 3, numels, 2, step=5)
    assert needs == [reshard.sources(numels, 3, 2, 0), reshard.sources(numels, 3, 2, 1)]
    assert moves == [(1, 1, 0)]
    with pytest.raises(ZeroShardsLostError, match=r"ranks \[1\] \(of 3\) at the commit of "
                       r"step 5.*run the same command again"):
        rebuild_plan([[0, 2], [2]], 3, numels, 2, step=5)


def _trained_one_rank_strategy(steps: int = 2, stage: int = 2, seed: int = 0) -> ZeroStrategy:
    """A live-mode ZeRO strategy (one rank, no group: it wraps over a group of one), trained."""
    torch.manual_seed(seed)
    strategy = ZeroStrategy(Runtime(0, 1, 0, "gloo", CPU, None, None), zero_stage=stage)
    strategy.setup(GPT(MODEL), adamw(0.1), loss_fn)
    for step in range(steps):
        _train(strategy, step)
    return strategy


def _cut(full: dict, world_size: int) -> list[dict]:
    """One rank's part -> the parts `world_size` ranks would have saved (`reshard`'s layout)."""
    parts = []
    for r in range(world_size):
        shards, moments = [], []
        for k, n in enumerate(full["numels"]):
            s = reshard.shard_numel(n, world_size)
            p, m = reshard.unit_state({0: full}, k, n, r * s, (r + 1) * s)
            shards.append(p)
            moments.append(m)
        parts.append({**full, "world_size": world_size, "rank": r, "shards": shards,
                      "moments": moments})
    return parts


def _same_state(a: dict, b: dict) -> None:
    assert a["world_size"] == b["world_size"] and a["rank"] == b["rank"]
    assert a["scalars"].keys() == b["scalars"].keys()
    for x, y in zip(a["shards"], b["shards"], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a["moments"], b["moments"], strict=True):
        assert x.keys() == y.keys() and x  # AdamW's moments, after its steps
        assert all(torch.equal(x[k], y[k]) for k in x)
    for k, v in a["scalars"].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["scalars"][k]))


def test_a_lost_ranks_buddy_copy_rebuilds_the_state_it_was_cut_from():
    strategy = _trained_one_rank_strategy()
    zero = strategy.model
    full = zero.shard_state_dict()
    parts = _cut(full, 3)
    copy_of_1 = moments_only(parts[1])  # what rank 1 sent its buddy: no parameters
    assert "shards" not in copy_of_1
    flats = [u.full[:u.plan.numel] for u in zero.units]  # the replicated model, here
    rebuilt = {0: parts[0], 1: with_params(copy_of_1, flats), 2: parts[2]}
    for a, b in zip(rebuilt[1]["shards"], parts[1]["shards"], strict=True):
        assert torch.equal(a, b)  # the parameter slice, padding included
    # A fresh wrapper (other weights) loads the rebuilt parts: the state it was cut from.
    torch.manual_seed(1)
    fresh = ZeroStrategy(Runtime(0, 1, 0, "gloo", CPU, None, None), zero_stage=2)
    fresh.setup(GPT(MODEL), adamw(0.1), loss_fn)
    fresh.model.load_shard_state_dicts(rebuilt)
    _same_state(fresh.model.shard_state_dict(), full)
    # The same parts as one rank's part (what a live snapshot holds) are that state too.
    _same_state(one_rank_part([rebuilt[r] for r in range(3)]), full)
    # The snapshot a live ZeRO strategy of one member writes is its whole state.
    strategy.live_hooks()
    _same_state(strategy.state_dict()["zero"], full)


def _rebuilt(hooks, held: Held | None, steps: int, rank: int, group) -> dict:
    """`hooks` re-sharded over a new generation (as its first step, or `settle`, does it): this
    member holding `held` of the commit after `steps` steps, rank `rank` of `group`."""
    hooks.held, hooks.steps = held, steps
    hooks.on_members(Runtime(rank, group.size(), 0, "gloo", CPU, group, None))
    hooks.settle()
    return hooks.strategy.model.shard_state_dict()


def test_stage_3_parts_carry_the_parameter_shards_and_rebuild_3_ranks_on_one():
    full = _trained_one_rank_strategy(stage=3).model.shard_state_dict()
    parts = _cut(full, 3)
    kept = buddy_part(parts[1])  # what rank 1 sends its buddy at stage 3: its parameters too
    assert all(torch.equal(a, b) for a, b in zip(kept["shards"], parts[1]["shards"], strict=True))
    # The survivor (other weights, a group of one) holds its own part and the copies of ranks 1
    # and 2: it loads all three, parameters and moments together, as the state they were cut from.
    hooks = _trained_one_rank_strategy(0, stage=3, seed=1).live_hooks()
    assert hooks.model.state_dict() == {}  # a GPT has no buffers: the loop commits nothing
    held = Held(2, 3, {r: buddy_part(parts[r]) for r in range(3)})
    one = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    module = hooks.strategy.module
    weight = next(module.parameters())
    weight.grad = torch.ones(weight.shape)  # left by a failed backward
    _same_state(_rebuilt(hooks, held, 2, 0, one), full)
    assert all(p.grad is None for p in module.parameters())  # not added to the redone step's


def _member_of_two(rank: int, full: dict, store: dist.Store, out: dict) -> None:
    # Rank 0 held the whole state alone (a layout of 1); rank 1 is a replacement: other
    # weights, nothing held (its heal sent no parameters at stage 3).
    hooks = _trained_one_rank_strategy(0, stage=3, seed=1 + rank).live_hooks()
    held = Held(2, 1, {0: buddy_part(full)}) if rank == 0 else None
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
    out[rank] = (_rebuilt(hooks, held, 2, rank, group), hooks.held)


def test_stage_3_rebuilds_one_members_state_on_two_with_a_replacement():
    full = _trained_one_rank_strategy(stage=3).model.shard_state_dict()
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_member_of_two, args=(r, full, store, out))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(out) == {0, 1}, "a member raised or hung: see the thread's traceback above"
    for r, want in enumerate(_cut(full, 2)):  # each member's shard of the 1-rank state, exact
        _same_state(out[r][0], want)
        assert out[r][1].size == 1 and sorted(out[r][1].parts) == [0]  # the part it now holds


def test_a_member_keeps_the_parts_of_the_commit_it_is_at_over_a_restore_and_a_heal():
    hooks = _trained_one_rank_strategy(0).live_hooks()
    peer = {"owner": "peer", "steps": 3}
    first = hooks.state_dict()  # the join's commit: this process's own start, not the job's
    assert hooks.held is not None and hooks.held.initial and first["steps"] == 0
    hooks.load_state_dict(peer)  # healed at generation 0: its start is not the job's
    assert hooks.held is None and hooks.steps == 3
    # A step trained up to its vote, then restored: kept aside, in case others committed it.
    part = {"world_size": 2, "rank": 0}
    hooks.pending = Held(4, 2, {0: part, 1: part})
    hooks.steps = 4
    mine = hooks.state_dict()  # committed: the pending step is the commit now
    assert hooks.held is not None and hooks.held.steps == 4 and hooks.pending is None
    hooks.pending, hooks.steps = Held(5, 2, {0: part, 1: part}), 5
    hooks.load_state_dict(mine)  # a fault in step 5: back to 4, step 5's parts in the stash
    assert hooks.steps == 4 and hooks.held.steps == 4 and hooks.stash is not None
    hooks.load_state_dict({"owner": "peer", "steps": 5})  # a peer had committed step 5
    assert hooks.held is not None and hooks.held.steps == 5 and sorted(hooks.held.parts) == [0, 1]
    hooks.load_state_dict({"owner": "peer", "steps": 6})  # behind with nothing of step 6
    assert hooks.held is None and hooks.steps == 6


def _train(strategy: ZeroStrategy, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, MODEL.vocab_size, (4, MODEL.block_size), generator=g)
    strategy.train_step([(x, x.roll(1, dims=1))], lr=1e-2, grad_clip=1.0)


def test_a_members_commit_is_a_copy_that_the_next_step_leaves_alone():
    # `shard_state_dict()` returns the optimizer's own moment buffers (`flat_moments`, for
    # `updated_state`): a commit that aliased them (`.cpu()` on a CPU tensor is the tensor
    # itself) would change with the next step, and a restore after a failed step would load
    # that failed step's moments.
    strategy = _trained_one_rank_strategy()
    assert strategy.updated_state() is not None  # not live: its buffers are copied beside
    hooks = strategy.live_hooks()
    assert strategy.updated_state() is None  # live: rank 0's snapshot is gathered copies
    hooks.state_dict()  # the first commit: this member's own part, moments only
    kept = hooks.held.parts[0]["moments"]
    before = [{k: v.clone() for k, v in m.items()} for m in kept]
    _train(strategy, 7)
    live = strategy.model.shard_state_dict()["moments"]
    assert any(not torch.equal(m[k], b[k]) for m, b in zip(live, before, strict=True) for k in m)
    for m, b in zip(kept, before, strict=True):
        assert m.keys() == b.keys() and m  # AdamW's moments, after the 2 steps
        assert all(torch.equal(m[k], b[k]) for k in m), "the commit changed with the next step"
