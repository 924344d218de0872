"""The writer process keeps the tensors it was sent (`ringtrain.checkpoint.writer._Known`).

    .venv/bin/pytest -q tests/test_writer_process.py

CPU. Each write's file must hold the values its tensors have at that write, whatever happened
to them since the last one: written in place (the same buffers, sent as numbers only), replaced
by new tensors, moved onto another storage (`set_`), freed; after a state that failed to pickle,
and after the process died and a new one started. The reference is the values themselves.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal

import pytest
import torch

from ringtrain.checkpoint.writer import WriterProcess


def _shared(*values: float) -> torch.Tensor:
    return torch.tensor(values).share_memory_()


def _written(writer: WriterProcess, path, state: dict) -> dict:
    writer.write(path, state)
    return torch.load(path, weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture
def writer():
    w = WriterProcess()
    yield w
    w.close()


def test_a_tensor_crosses_once_and_each_write_has_its_values(writer, tmp_path):
    state = {"w": _shared(1.0, 2.0), "m": _shared(3.0), "step": 1}
    assert _same(_written(writer, tmp_path / "a.pt", state), state)
    (first, new, gone), _ = writer._known.message(state)  # noqa: SLF001 - what a write sends
    assert (new, gone) == ({}, [])  # both held: numbers only
    state["w"].add_(10)  # the next save's copy lands in the same buffer
    state["step"] = 2
    got = _written(writer, tmp_path / "b.pt", state)
    assert _same(got, state) and got["w"].tolist() == [11.0, 12.0]


def test_replaced_moved_and_freed_tensors_are_sent_again_and_forgotten(writer, tmp_path):
    state = {"w": _shared(1.0, 2.0), "m": _shared(3.0)}
    _written(writer, tmp_path / "a.pt", state)
    state["m"] = _shared(4.0)  # a new buffer (the old one freed here)
    gc.collect()
    (_, new, gone), _ = writer._known.message(state)  # noqa: SLF001
    assert len(new) == 1 and len(gone) == 1
    assert _same(_written(writer, tmp_path / "b.pt", state), state)
    state["w"].set_(_shared(5.0, 6.0, 7.0).untyped_storage())  # the same object, moved
    (_, new, gone), _ = writer._known.message(state)  # noqa: SLF001
    assert len(new) == 1 and len(gone) == 1
    got = _written(writer, tmp_path / "c.pt", state)
    assert got["w"].tolist() == [5.0, 6.0, 7.0] and _same(got, state)
    del state["m"]
    gc.collect()
    assert _same(_written(writer, tmp_path / "d.pt", state), state)
    assert len(writer._known._held) == 1  # noqa: SLF001 - the freed one forgotten


def test_a_failed_pickle_and_a_new_process_leave_nothing_stale(writer, tmp_path):
    state = {"w": _shared(1.0)}
    _written(writer, tmp_path / "a.pt", state)
    bad = {"w": state["w"], "x": _shared(2.0), "f": lambda: 0}  # a lambda does not pickle
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        writer.write(tmp_path / "bad.pt", bad)
    state["x"] = bad["x"]  # never sent: must go as new, not as the number the failed try took
    assert _same(_written(writer, tmp_path / "b.pt", state), state)
    os.kill(writer._process.pid, signal.SIGKILL)  # noqa: SLF001
    writer._process.join(5)  # noqa: SLF001 - the next write starts a new process
    state["w"].add_(1)
    assert _same(_written(writer, tmp_path / "c.pt", state), state)  # a new process, sent anew
