"""The host copy's plan kept from save to save (ringtrain/checkpoint/copy_plan.py), CPU only: a
save whose state is the plan's is replayed, any other is walked in full and re-recorded, and
either way the copy is what a synchronous save writes and what the full walk copies, byte for
byte."""

from __future__ import annotations

import torch
from test_kept_views import _saved, _tied_model_and_adamw

from ringtrain.checkpoint.host_copy import HostCopy


def _model_and_adamw():
    model, _ = _tied_model_and_adamw()
    model["norm"] = torch.nn.BatchNorm1d(8)  # buffers: copied in the step, not deferred
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model, opt) -> None:
    x = torch.randint(0, 11, (4, 3))
    h = model["mid"](model["emb"](x))
    model["head"](model["norm"](h.transpose(1, 2)).transpose(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def _later(model, opt) -> list[torch.Tensor]:
    return list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                       if v.dim()]


class _Saves:
    """Saves of one state through a planned host copy and the full walk's, side by side."""

    def __init__(self) -> None:
        self.planned, self.walk = HostCopy(), HostCopy(planned=False)

    def save(self, state, later) -> bool:
        """One save through both; True if the planned one replayed its plan. Asserts each copy
        is the synchronous save's bytes (read after `finish`, as the writer does)."""
        expected = _saved(state)
        before = self.planned.replays
        copies, figures = [], []
        for host in (self.planned, self.walk):
            staged = host.copy(state, later=later)
            staged.finish()
            copies.append(_saved(staged.state))
            figures.append((staged.bytes, staged.later_bytes, host.bytes))
        assert copies[0] == expected and copies[1] == expected
        assert figures[0] == figures[1]  # the snapshot's log line says the same
        assert self.walk.replays == 0
        return self.planned.replays > before


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}


def test_a_state_like_the_last_is_replayed_and_writes_the_walks_bytes():
    model, opt = _model_and_adamw()
    _train_step(model, opt)
    saves = _Saves()
    replayed = []
    for _ in range(5):
        _train_step(model, opt)  # values change in place; lr from the schedule may change too
        opt.param_groups[0]["lr"] *= 0.5
        replayed.append(saves.save(_state(model, opt), _later(model, opt)))
    # The first save's deferred buffers are made by `finish` (no plan); the second records.
    assert replayed == [False, False, True, True, True]


def test_a_replaced_tensor_or_another_deferred_set_walks_in_full():
    model, opt = _model_and_adamw()
    _train_step(model, opt)
    saves = _Saves()
    for _ in range(3):
        saves.save(_state(model, opt), _later(model, opt))
    with torch.no_grad():
        model["mid"].weight.data = model["mid"].weight.data.clone()  # a new storage (deferred)
    assert not saves.save(_state(model, opt), _later(model, opt))
    model["norm"].running_mean = model["norm"].running_mean.clone()  # a buffer: copied now
    assert not saves.save(_state(model, opt), _later(model, opt))  # and records (no deferred)
    assert saves.save(_state(model, opt), _later(model, opt))


def test_a_resized_or_reshaped_tensor_walks_in_full():
    t = torch.arange(12.0)
    saves = _Saves()
    for _ in range(2):
        saves.save({"t": t, "v": t[2:6]}, [])
    assert saves.save({"t": t, "v": t[2:6]}, [])  # nothing deferred: the first records
    assert not saves.save({"t": t, "v": t[2:8]}, [])  # the same storage, another shape
    assert saves.save({"t": t, "v": t[2:8]}, [])
    assert not saves.save({"t": t.view(3, 4), "v": t[2:8]}, [])  # strides
    t.resize_(20)  # a storage made larger (the same tensor object)
    assert not saves.save({"t": t, "v": t[2:8]}, [])
    # A storage first met through a part of it, or through a transpose: copied whole, by bytes.
    for state in ({"v": t[2:8], "t": t}, {"tt": t.view(4, 5).t(), "t": t}):
        assert not saves.save(state, [])
        assert saves.save(state, [])


def test_a_key_added_or_storages_shared_differently_walks_in_full():
    # Distinct tensor objects, as a state_dict's (one object twice is pickled once in a
    # synchronous save, as a reference: the copy makes two, and its file differs already)
    a, b = torch.ones(4), torch.zeros(4)
    saves = _Saves()
    for _ in range(2):
        saves.save({"a": a, "b": b}, [])
    assert saves.save({"a": a, "b": b, "n": 1}, [])  # a key that is no tensor: the same plan
    assert not saves.save({"a": a, "b": b, "c": torch.ones(2)}, [])  # a tensor more
    assert not saves.save({"a": a, "b": b}, [])  # one fewer
    assert not saves.save({"a": a, "b": a[:]}, [])  # b now shares a's storage
    assert saves.save({"a": a, "b": a[:]}, [])
    assert not saves.save({"b": a[:], "a": b}, [])  # the same tensors in another order
    shared = (a, a[:])
    assert not saves.save({"x": shared, "y": shared}, [])  # one container met twice
    assert saves.save({"x": shared, "y": shared}, [])


def test_without_a_plan_every_save_walks_and_rare_tensors_are_copied_afresh():
    model, opt = _model_and_adamw()
    _train_step(model, opt)
    host = HostCopy(planned=False)
    for _ in range(3):
        state = _state(model, opt)
        staged = host.copy(state, later=_later(model, opt))
        staged.finish()
        assert _saved(staged.state) == _saved(state)
    assert host.replays == 0
    saves = _Saves()
    sparse = torch.eye(3).to_sparse()  # no strides: no plan, a plain copy each time
    for _ in range(3):
        assert not saves.save({"s": sparse, "d": torch.ones(2)}, [])


def test_a_replayed_copy_holds_the_saves_values_not_the_later_ones():
    model, opt = _model_and_adamw()
    _train_step(model, opt)
    host = HostCopy()
    for _ in range(4):
        _train_step(model, opt)
        state = _state(model, opt)
        expected = _saved(state)
        staged = host.copy(state, later=_later(model, opt))
        staged.guard([opt])
        staged.finish()  # the writer thread's copy of the deferred state
        _train_step(model, opt)  # the next step changes the live tensors in place
        staged.unguard()
        assert _saved(staged.state) == expected
    assert host.replays == 2


def test_auto_writer_sizes_a_repeat_save_from_the_last_copy(monkeypatch):
    """"auto" picks the writer from the state's size: walked once at the first save, then the
    last copy's size (no second walk in the step), which follows the state if it changes."""
    from ringtrain.checkpoint import background

    walks, state_bytes = [], background.state_bytes
    monkeypatch.setattr(background, "state_bytes", lambda s: walks.append(1) or state_bytes(s))
    saves = background.BackgroundSaves()
    small, grown = {"w": torch.ones(4)}, {"w": torch.ones(4), "b": torch.ones(8)}
    for state in (small, small, grown, grown):
        staged = saves.stage((state, None), None)
        staged.finish()
        saves.drop()
        assert saves.using == "thread"
        assert saves._last_bytes == sum(t.untyped_storage().nbytes() for t in state.values())
    assert walks == [1]
