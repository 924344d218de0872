"""Start-up, validation and teardown of the process group (`ringtrain.runtime`)."""

import contextlib
import os
import time

import pytest
import torch.distributed as dist

from ringtrain.launch.network import free_port, reserve_port
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.runtime import DistributedInitError, get_rank
from ringtrain.testing import WorkerError, run_workers

_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)
    yield
    destroy_distributed()


def test_single_process_fallback_and_idempotent_teardown():
    rt = init_distributed()
    assert (rt.rank, rt.world_size, rt.backend) == (0, 1, "gloo")
    assert init_distributed() is rt
    destroy_distributed()
    destroy_distributed()
    assert not dist.is_initialized()


def test_rank_helpers_before_init_raise():
    with pytest.raises(DistributedInitError, match="init_distributed"):
        get_rank()


def test_missing_variables_listed_together(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedInitError) as e:
        init_distributed()
    msg = str(e.value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        assert name in msg
    assert "ringtrain run --nproc-per-node" in msg


@pytest.mark.parametrize("rank,world,match", [(2, 2, r"Invalid rank 2.*\[0, 1\]"),
                                              (-1, 2, "Invalid rank -1"),
                                              (0, 0, "world_size=0")])
def test_bad_rank_or_world(rank, world, match):
    with pytest.raises(DistributedInitError, match=match):
        init_distributed(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=29500)


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_missing_rank_fails_within_bound_naming_arrivals():
    t0 = time.monotonic()
    with reserve_port() as port, pytest.raises(
            DistributedInitError, match=r"only 1 ranks joined.*\[0\] arrived, \[1\] missing"):
        init_distributed("gloo", rank=0, world_size=2, master_addr="127.0.0.1",
                         master_port=port, rendezvous_timeout_s=2)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_unreachable_master_fails_within_bound():
    t0 = time.monotonic()
    with pytest.raises(DistributedInitError, match="could not reach the master at 127.0.0.1"):
        init_distributed("gloo", rank=1, world_size=2, master_addr="127.0.0.1",
                         master_port=free_port(), rendezvous_timeout_s=2)
    assert time.monotonic() - t0 < 10


def _report(rank, world_size):
    import torch

    from ringtrain.runtime import get_runtime

    rt = get_runtime()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rt.rank, rt.world_size, t.item()


def test_two_ranks_start_and_reduce():
    out = run_workers(_report, 2, timeout_s=60)
    assert out == [(0, 2, 3.0), (1, 2, 3.0)]


def _duplicate(rank, world_size, port):
    init_distributed("gloo", rank=0, world_size=2, master_addr="127.0.0.1", master_port=port,
                     rendezvous_timeout_s=5)


def test_duplicate_rank_is_an_error():
    # Both processes claim rank 0; the second to arrive is told so (or fails to bind the port).
    with pytest.raises(WorkerError, match="joined twice|could not listen"):
        with reserve_port() as port:
            run_workers(_duplicate, 2, args=(port,), init=False, timeout_s=30)


def test_env_variables_are_read(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    rt = init_distributed()
    assert rt.world_size == 1
    assert os.environ["WORLD_SIZE"] == "1"


def test_bad_gloo_interface_lists_real_ones(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(DistributedInitError, match=r"nosuch0.*interfaces: .*lo \(127.0.0.1\)"):
        init_distributed("gloo", rank=0, world_size=2, master_addr="127.0.0.1",
                         master_port=free_port())


def test_a_reserved_port_goes_to_no_other_bind_but_a_store_listens_on_it():
    # What run_workers and the launch tests rely on: between picking MASTER_PORT and rank 0's
    # store listening on it, no other process's bind to port 0 (a gloo listener) gets it.
    import datetime
    import socket

    with contextlib.ExitStack() as held:
        ports = {held.enter_context(reserve_port()) for _ in range(200)}
        for _ in range(5000):  # ~36 of them would land on a held port if it were free again
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] not in ports
        port = next(iter(ports))
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
