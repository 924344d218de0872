"""Store keys come from the caller's name, not from how many objects a process made before.

    .venv/bin/pytest -q tests/test_store_keys.py

Two ranks that build their watchdogs, snapshot managers and membership views in different
orders still meet under the same keys; two objects of one rank with the same name on the same
store are refused (`ringtrain.store_keys.claim_key`), where they would silently share keys.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ringtrain.agreement.membership import Membership
from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.launch.watchdog import Watchdog
from ringtrain.runtime import get_runtime
from ringtrain.testing import run_workers

# ---- one process: a name is taken once per store and rank -------------------------------------


def test_a_membership_name_is_taken_once_per_store_and_rank():
    store = dist.HashStore()
    runtime = SimpleNamespace(store=store, rank=0, world_size=2)
    Membership.of(runtime, "a")
    Membership.of(runtime, "b")  # another name: fine
    Membership(store, 1, 2, scope="a")  # another rank (a test playing both): fine
    # Another store: fine.
    Membership.of(SimpleNamespace(store=dist.HashStore(), rank=0, world_size=2), "a")
    with pytest.raises(ValueError, match=r"a Membership named 'a' .* already exists for rank 0 in "
                                         r"this process.*pass a distinct name="):
        Membership.of(runtime, "a")


def test_a_watchdog_name_is_taken_once_per_store_rank_and_restart(monkeypatch):
    store = dist.HashStore()
    Watchdog(store, 0, 2, name="train")
    Watchdog(store, 0, 2, name="run")
    with pytest.raises(ValueError, match=r"a Watchdog named 'train' \(store keys "
                                         r"'ringtrain/watchdog/.*/0/train'\) already exists"):
        Watchdog(store, 0, 2, name="train")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart has keys of its own
    Watchdog(store, 0, 2, name="train")


def test_a_snapshot_manager_name_is_taken_once_per_directory_store_and_rank(tmp_path):
    store = dist.HashStore()
    SnapshotManager(tmp_path / "x", rank=0, world_size=2, store=store, name="trainer")
    SnapshotManager(tmp_path / "y", rank=0, world_size=2, store=store, name="trainer")  # other dir
    SnapshotManager(tmp_path / "x", rank=0, world_size=2, store=store, name="resumed")
    with pytest.raises(ValueError,
                       match="a SnapshotManager named 'trainer' .* pass a distinct name="):
        SnapshotManager(tmp_path / "x", rank=0, world_size=2, store=store, name="trainer")
    for _ in range(2):  # one rank alone uses no store keys: nothing to collide
        SnapshotManager(tmp_path / "x", rank=0, world_size=1, name="trainer")


# ---- two ranks, objects built in opposite orders -------------------------------------------------


def _opposite_orders(rank, world_size, root):
    """Rank 0 builds "a" then "b", rank 1 "b" then "a"; then both use "a", then "b"."""
    rt = get_runtime()
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    views = {n: Membership.of(rt, n, timeout_s=20) for n in names}
    managers = {n: SnapshotManager(root, rank=rank, world_size=world_size, store=rt.store,
                                   timeout_s=20, name=n) for n in names}
    watchdogs = {n: Watchdog(name=n, interval_s=0.1, timeout_s=20, excepthook=False,
                             on_dead=lambda failure: None).start() for n in names}
    try:
        sums = [views["a"].reduce("x", [1.0 + rank]), views["b"].reduce("x", [10.0 * (rank + 1)])]
        steps = [managers["a"].save(1, shared={"n": "a"}).step,
                 managers["b"].save(2, shared={"n": "b"}).step]
        # Each watchdog's peer beats under the key its own name gives: the names alone agree.
        run = f"ringtrain/watchdog/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/0"
        peer = 1 - rank
        deadline = time.monotonic() + 20
        while not all(rt.store.add(f"{run}/{n}/hb/{peer}", 0) > 0 for n in names):
            assert time.monotonic() < deadline, "a peer's heartbeat never showed under its name"
            time.sleep(0.05)
        dist.barrier()
    finally:
        for w in watchdogs.values():
            w.stop()
    return sums, steps, [watchdogs[n].failure for n in ("a", "b")]


def test_objects_built_in_opposite_orders_still_meet(tmp_path):
    results = run_workers(_opposite_orders, 2, args=(str(tmp_path),), timeout_s=90)
    for sums, steps, failures in results:
        assert sums == [[3.0], [30.0]]
        assert steps == [1, 2]
        assert failures == [None, None]
