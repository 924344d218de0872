"""The host copy's tensors kept from save to save (ringtrain/checkpoint/kept_views.py): the files
stay a synchronous save's, byte for byte, and nothing stale is handed out again."""

from __future__ import annotations

import io

import pytest
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


def _saves(host: HostCopy, model, opt, n: int = 3) -> list[tuple[bytes, bytes]]:
    """`n` saves through `host`, each (the synchronous bytes, the background copy's bytes)."""
    later = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                        if v.dim()]
    out = []
    for _ in range(n):
        _train_step(model, opt)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        expected = _saved(state)
        staged = host.copy(state, later=later)
        staged.finish()
        out.append((expected, _saved(staged.state)))
    return out


def test_batched_copies_write_the_per_tensor_files_in_a_few_calls():
    # CPU: the non-deferred copies in the step, the deferred ones in `finish`: one call each.
    files, calls = {}, {}
    for batched in (True, False):
        model, opt = _tied_model_and_adamw()
        _train_step(model, opt)
        host = HostCopy(batched=batched)
        files[batched] = _saves(host, model, opt)
        calls[batched] = host.copy_calls
    assert files[True] == files[False]  # the same training, the same bytes either way
    assert all(expected == got for expected, got in files[True])  # and a synchronous save's
    # A save's storages: AdamW's 3 step counts (0-dim, copied in the step) and 9 deferred (the
    # 3 parameters, the embedding tied to the head, and their 6 moments).
    assert calls[True] == 3 * 2, calls  # one call in the step, one in `finish`, per save
    assert calls[False] == 3 * (3 + 9), calls


def test_a_torch_that_refuses_the_batch_or_lacks_it_falls_back_to_one_call_per_tensor(
        monkeypatch):
    from ringtrain.torch_internals import TorchFeatureWarning, foreach

    def refuse(dsts, srcs, non_blocking=False):
        raise RuntimeError("foreach copy: this torch refuses these inputs")

    monkeypatch.setattr(foreach, "_refused", [])  # said once per process: hear it here
    monkeypatch.setattr(foreach, "_foreach_copy", refuse)
    model, opt = _tied_model_and_adamw()
    _train_step(model, opt)
    host = HostCopy()
    with pytest.warns(TorchFeatureWarning, match="refuses these inputs.*one call per tensor"):
        saves = _saves(host, model, opt, n=2)
    assert all(expected == got for expected, got in saves)
    refused_calls = host.copy_calls
    monkeypatch.setattr(foreach, "_foreach_copy", None)  # a torch without the name
    model, opt = _tied_model_and_adamw()
    _train_step(model, opt)
    host = HostCopy()
    assert all(expected == got for expected, got in _saves(host, model, opt, n=2))
    assert host.copy_calls == refused_calls == 2 * (3 + 9)  # one per storage, both ways
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        foreach.copy_tensors([torch.zeros(1)] * 2, [torch.ones(1)])
