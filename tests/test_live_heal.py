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

import torch
import torch.distributed as dist

from ringtrain.live import GlobalBatches, LiveState, WatchedGroup, heal
from ringtrain.tensor_tree import INLINE_BYTES, split_large


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
