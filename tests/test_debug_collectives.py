"""RINGTRAIN_DEBUG=collectives: a mismatched collective raises on every rank naming both calls.

    .venv/bin/pytest -q tests/test_debug_collectives.py

Two gloo ranks in one spawn; each case runs on a fresh process group, so a case that leaves
the ranks out of step (one rank skipped a call) does not leak into the next.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from ringtrain import collectives
from ringtrain.agreement.base import CollectiveAgreement
from ringtrain.testing import run_workers
from ringtrain.zero import ZeroDataParallel

ENV = {"RINGTRAIN_DEBUG": "collectives", "RINGTRAIN_DEBUG_TIMEOUT": "2"}


def _caught(fn) -> str | None:
    try:
        fn()
    except collectives.CollectiveMismatchError as e:
        return str(e)
    return None


def _cases(rank, world_size):
    out = {}
    g = dist.new_group([0, 1])
    t = torch.ones(3) * (rank + 1)
    collectives.all_reduce(t, group=g)  # matching calls: checked, then run as usual
    out["sum"] = t.tolist()

    g = dist.new_group([0, 1])
    out["shape"] = _caught(lambda: collectives.all_reduce(torch.zeros(4 + rank), group=g))

    g = dist.new_group([0, 1])
    out["op"] = _caught(lambda: collectives.all_reduce(torch.zeros(2), group=g) if rank == 0
                        else collectives.broadcast(torch.zeros(2), 0, group=g))

    g = dist.new_group([0, 1])
    out["dtype"] = _caught(lambda: collectives.all_reduce(
        torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.int64), group=g))

    g = dist.new_group([0, 1])
    collectives.barrier(group=g)
    out["skip"] = _caught(lambda: collectives.all_reduce(torch.zeros(2), group=g) if rank == 0
                          else None)  # rank 1 skips it and goes on
    dist.barrier()  # (unchecked) rank 1 waits here while rank 0 times out

    # ringtrain's own collectives are checked too: the trainer's agreement, here.
    g = dist.new_group([0, 1])
    agreement = CollectiveAgreement(g, world_size)
    out["agreement"] = _caught(lambda: agreement.sum([1.0] * (2 + rank)))

    # ZeRO's collectives: two matching stage-3 steps go through the checks untouched; then a
    # model that differs on rank 1 is caught at its first collective (the broadcast), named.
    torch.manual_seed(0)
    model = ZeroDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                             lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3,
                             process_group=dist.new_group([0, 1]))
    for _ in range(2):
        model(torch.ones(2, 4) * (rank + 1)).sum().backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
    out["zero"] = [round(v, 6) for v in model.full_state_dict()["0.weight"].flatten().tolist()]
    out["zero_mismatch"] = _caught(lambda: ZeroDataParallel(
        torch.nn.Linear(4, 3 + rank), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2,
        process_group=dist.new_group([0, 1])))
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_cases, 2, env=ENV, timeout_s=90)


def test_matching_calls_run_as_usual(results):
    assert [r["sum"] for r in results] == [[3.0, 3.0, 3.0]] * 2


@pytest.mark.parametrize("case, first, second", [
    ("shape", r"rank 0 calls all_reduce\(\(4,\) float32\)",
     r"rank 1 calls all_reduce\(\(5,\) float32\)"),
    ("op", r"rank 0 calls all_reduce\(\(2,\) float32\) reduce_op=",
     r"rank 1 calls broadcast\(\(2,\) float32\) src=0"),
    ("dtype", r"rank 0 calls all_reduce\(\(2,\) float32\)",
     r"rank 1 calls all_reduce\(\(2,\) int64\)"),
    ("agreement", r"rank 0 calls all_reduce\(\(2,\) float64\)",
     r"rank 1 calls all_reduce\(\(3,\) float64\)"),
])
def test_a_mismatch_raises_on_every_rank_naming_both_calls(results, case, first, second):
    for r in results:
        msg = r[case]
        assert msg is not None and "differs between ranks" in msg
        assert re.search(first, msg) and re.search(second, msg), msg
        assert "test_debug_collectives.py:" in msg  # the call site
    if case == "agreement":  # ringtrain's own call, and the user's line that reached it
        assert "agreement/base.py" in results[0][case] and "called from" in results[0][case]
    assert results[0][case] == results[1][case]  # the same words on every rank


def test_a_rank_that_skips_a_call_is_named_with_its_last_call(results):
    msg = results[0]["skip"]
    assert msg is not None, results
    assert "rank 0 calls all_reduce((2,) float32)" in msg
    assert "rank 1 did not reach it within 2 s" in msg
    assert "rank 1's last collective was #1: barrier()" in msg
    assert results[1]["skip"] is None  # the rank that skipped is not waiting anywhere


def test_off_by_default_costs_no_handshake(monkeypatch):
    monkeypatch.delenv("RINGTRAIN_DEBUG", raising=False)
    assert not collectives.enabled()
    collectives.check("all_reduce", [torch.zeros(1)])  # no process group needed: nothing is done
    monkeypatch.setenv("RINGTRAIN_DEBUG", "trace, collectives")
    assert collectives.enabled()
    assert os.environ["RINGTRAIN_DEBUG"]


def test_zero_steps_pass_the_checks_and_a_mismatched_model_is_named(results):
    assert results[0]["zero"] == results[1]["zero"]  # the same update on both ranks
    for r in results:
        msg = r["zero_mismatch"]
        assert msg is not None and "differs between ranks" in msg, r
        assert "zero/sharded.py" in msg, msg  # ZeRO's own call, named
