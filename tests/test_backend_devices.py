"""A module on a device its process group's backend cannot move: DistributedDataParallel and
ZeroDataParallel name it, with the fix, before any collective (torch fails in the first one:
"No backend type associated with device type cpu"). `ringtrain.ddp.ctor_args` reads the group's
backend; here a gloo group reported as NCCL (the real NCCL case: tests/test_cuda.py).

    .venv/bin/pytest -q tests/test_backend_devices.py
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.testing import run_workers
from ringtrain.zero import ZeroDataParallel


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


class _Grouped(nn.Module):
    """A module whose buffer stays where it was made (pytorch#109103's case)."""

    def __init__(self):
        super().__init__()
        self.layer = _net()
        self.register_buffer("scale", torch.ones(3))


def _backend_devices(rank, world_size):
    """The group's backend said to be NCCL (gloo carries every collective that does happen): a
    CPU module is refused on every rank, by name, before anything is sent (no hang)."""
    out = {}
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        for name, make in (
            ("ddp", lambda: DistributedDataParallel(_Grouped())),
            ("ddp_no_buffer_sync", lambda: DistributedDataParallel(
                _Grouped(), forward_sync_buffers=False, init_sync=False)),
            ("zero", lambda: ZeroDataParallel(
                _Grouped(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3)),
        ):
            with mock.patch.object(dist, "get_backend", return_value=backend):
                try:
                    make()
                    out[f"{backend}/{name}"] = None
                except ValueError as e:
                    out[f"{backend}/{name}"] = (type(e), str(e))
    dist.barrier()  # both ranks got here: the refusals sent nothing, so nothing waits
    return out


def test_a_module_on_a_device_the_backend_cannot_move_is_refused_by_name():
    for out in run_workers(_backend_devices, 2, timeout_s=120):
        kind, text = out["nccl/ddp"]
        assert issubclass(kind, RuntimeError)  # what torch raises, at its first collective
        assert text.startswith("DistributedDataParallel: layer.0.weight (and 4 more) is on cpu, "
                               "but the process group's backend 'nccl' moves only cuda tensors")
        assert "model.to(rt.device)" in text and "RINGTRAIN_BACKEND=gloo" in text
        assert "No backend type associated with device type cpu" in text  # torch's words
        # Without buffer sync the buffer is never sent, but the parameters still are.
        assert "(and 3 more)" in out["nccl/ddp_no_buffer_sync"][1]
        assert out["nccl/zero"][1].startswith("ZeroDataParallel: layer.0.weight (and 4 more)")
        # One backend per device type, the CPU's among them: accepted.
        assert all(v is None for k, v in out.items() if k.startswith("cpu:gloo")), out


def test_backend_devices_reads_torchs_backend_names(monkeypatch):
    from ringtrain.ddp.ctor_args import backend_devices, check_backend_devices

    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

        def name(self):  # what a group made outside torch's registry answers (a live one)
            return "nccl"

    for name, served in (("nccl", {"cuda": "nccl"}), ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
                         ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
                         ("mpi", None), ("fake", None)):
        monkeypatch.setattr(dist, "get_backend", lambda group, name=name: name)
        assert backend_devices(Group(2)) == served, name
    cpu = [("w", torch.zeros(1))]
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    check_backend_devices(cpu, Group(1))  # one rank sends nothing: not refused
    with pytest.raises(ValueError, match="w is on cpu"):
        check_backend_devices(cpu, Group(2))
    monkeypatch.setattr(dist, "get_backend", lambda group: "mpi")
    check_backend_devices(cpu, Group(2))  # a backend of its own devices: not ours to refuse

    def unregistered(group):
        raise ValueError("Process group ... is not initialized in the world group map")

    monkeypatch.setattr(dist, "get_backend", unregistered)
    assert backend_devices(Group(2)) == {"cuda": "nccl"}
