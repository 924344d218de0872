"""The host copy's tensors kept from save to save (ringtrain/checkpoint/kept_views.py): the files
stay a synchronous save's, byte for byte, and nothing stale is handed out again."""

from __future__ import annotations

import io

import torch

from ringtrain.checkpoint.host_copy import HostCopy
from ringtrain.checkpoint.kept_views import ByteViews


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _tied_model_and_adamw():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 8)
    head = torch.nn.Linear(8, 11, bias=False)
    head.weight = emb.weight  # tied, as the GPT's embedding and head
    model = torch.nn.ModuleDict({"emb": emb, "mid": torch.nn.Linear(8, 8), "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _train_step(model, opt) -> None:
    x = torch.randint(0, 11, (4, 3))
    model["head"](model["mid"](model["emb"](x))).sum().backward()
    opt.step()
    opt.zero_grad()


def test_every_save_writes_the_synchronous_bytes_while_its_tensors_are_reused():
    model, opt = _tied_model_and_adamw()
    _train_step(model, opt)
    later = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                        if v.dim()]
    host = HostCopy()
    last = None
    for i in range(4):
        _train_step(model, opt)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        expected = _saved(state)  # what a synchronous save of this step writes
        staged = host.copy(state, later=later)
        staged.finish()  # the writer's thread: the deferred sources copied
        assert _saved(staged.state) == expected
        emb, head = staged.state["model"]["emb.weight"], staged.state["model"]["head.weight"]
        assert emb is not head and emb.untyped_storage().data_ptr() == \
            head.untyped_storage().data_ptr()  # tied: two tensors on one storage, as the source
        if i >= 2:  # the same buffers and shapes: the same tensor objects (the first save's
            # deferred tensors were made before their buffers, by the writer: from the third on)
            assert staged.state["model"]["mid.weight"] is last["model"]["mid.weight"]
        last = staged.state


def test_a_storage_resized_in_place_is_not_copied_through_a_stale_view():
    views = ByteViews()
    buf = torch.arange(16, dtype=torch.uint8).untyped_storage()
    first = views.of(buf)
    views.start()
    assert views.of(buf) is first  # the same storage, the same bytes: kept
    buf.resize_(0)  # freed in place (the buffers kept are ours, never resized: a guard)
    buf.resize_(16)
    torch.empty(0, dtype=torch.uint8).set_(buf).copy_(torch.full((16,), 7, dtype=torch.uint8))
    views.start()
    again = views.of(buf)
    assert again.data_ptr() == buf.data_ptr() and torch.equal(again, torch.full((16,), 7,
                                                                                dtype=torch.uint8))
    host = torch.zeros(16, dtype=torch.uint8).untyped_storage()
    views.copy(host, buf, non_blocking=False)
    assert bytes(host) == bytes([7] * 16)
