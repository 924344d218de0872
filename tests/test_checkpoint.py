"""Snapshots: commit marker last, checksums, fallback, retention, bounded collective save; RNG.

    .venv/bin/pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain.checkpoint.rng import get_rng_state, set_rng_state
from ringtrain.checkpoint.snapshot import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotManager,
    check_topology,
    load_model_state_dict,
    unwrap_state_dict,
)
from ringtrain.data.sampler import DistributedSampler
from ringtrain.testing import WorkerError, run_workers


def _state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    schedule.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    sampler = DistributedSampler(range(100), num_replicas=1, rank=0)
    next(iter(sampler))
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "lr_schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "sampler": sampler.state_dict(), "step": seed}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _save(mgr, step, seed=None):
    return mgr.save(step, shared=_state(step if seed is None else seed),
                    per_rank={"rng": get_rng_state()}, metadata={"config": {"lr": 1e-3}})


def _flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_save_load_round_trip(tmp_path):
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1)
    assert mgr.latest() is None
    result = _save(mgr, 7)
    snap = mgr.latest()
    assert snap.step == 7 and snap.path == result.path == tmp_path / "snap-00000007"
    assert sorted(os.listdir(snap.path)) == ["COMMITTED", "manifest.json", "rank0.pt", "shared.pt"]
    assert result.bytes == result.total_bytes == sum(
        (snap.path / n).stat().st_size for n in ("shared.pt", "rank0.pt"))
    assert result.write_s > 0 and result.total_s >= result.write_s
    shared, per_rank, metadata = mgr.load(snap)  # weights_only=True reads all of it
    assert _equal(shared, _state(7))
    assert set(per_rank["rng"]) == {"python", "numpy", "torch"}
    assert metadata == {"config": {"lr": 1e-3}, "step": 7, "world_size": 1}
    json.dumps(shared["sampler"])


def test_a_file_hashed_beside_its_write_and_written_back_early_is_the_reference(tmp_path,
                                                                              monkeypatch):
    """`write_durably`'s parallel hash and early writeback (the defaults) write the same bytes
    and digest as the reference (in line, all flushed by the fsync): large tensors go through
    the hashing thread, the writeback starts every 1 MB here."""
    import ringtrain.checkpoint.files as files

    monkeypatch.setattr(files, "WRITEBACK_BYTES", 1 << 20)
    torch.manual_seed(0)
    state = {"big": [torch.randn(1 << 17) for _ in range(6)], "small": torch.arange(5),
             "meta": {"step": 3}}  # 512 KB tensors: past PARALLEL_HASH_MIN_BYTES
    out = {}
    for parallel in (False, True):
        for writeback in (False, True):
            path = tmp_path / f"{parallel}-{writeback}.pt"
            out[parallel, writeback] = (files.write_durably(path, state, parallel=parallel,
                                                            writeback=writeback),
                                        path.read_bytes())
    ref_info, ref_bytes = out[False, False]
    assert ref_info["sha256"] == files.sha256_file(tmp_path / "False-False.pt")
    assert ref_info["bytes"] == len(ref_bytes) > 6 * (1 << 19)
    for info, raw in out.values():
        assert info == ref_info and raw == ref_bytes


def test_uncommitted_and_partial_snapshots_are_ignored(tmp_path):
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1)
    _save(mgr, 10)
    # A save that crashed after the rename, before COMMITTED (complete files, no marker)...
    shutil.copytree(tmp_path / "snap-00000010", tmp_path / "snap-00000020")
    (tmp_path / "snap-00000020" / "COMMITTED").unlink()
    # ...and one that crashed while writing, in its temp directory.
    partial = tmp_path / ".tmp-snap-00000030-deadbeef"
    partial.mkdir()
    (partial / "shared.pt").write_bytes(
        (tmp_path / "snap-00000010" / "shared.pt").read_bytes()[:100]
    )
    with pytest.warns(UserWarning, match="snap-00000020: .*no COMMITTED marker"):
        snap = mgr.latest()
    assert snap.step == 10 and [s.step for s in mgr.snapshots()] == [10]
    _save(mgr, 40)  # the next save clears the debris
    assert sorted(os.listdir(tmp_path)) == ["snap-00000010", "snap-00000040"]


def _crash_mid_write(rank, world_size, root):
    mgr = SnapshotManager(root, rank=0, world_size=1)
    _save(mgr, 1)
    # shared.pt is written, then the process dies while writing rank0.pt: a crash mid-snapshot.
    mgr.save(2, shared=_state(2), per_rank={"rng": get_rng_state(), "boom": _ExitWhilePickled()})


class _ExitWhilePickled:
    """Kills the process while torch.save is serialising it."""

    def __reduce__(self):
        os._exit(3)


def test_crash_in_the_middle_of_writing_then_previous_is_used(tmp_path):
    with pytest.raises(WorkerError, match="exited with code 3"):
        run_workers(_crash_mid_write, 1, args=(str(tmp_path),), init=False, timeout_s=60)
    (partial,) = tmp_path.glob(".tmp-snap-00000002-*")
    assert (partial / "shared.pt").stat().st_size > 0 and (partial / "rank0.pt").exists()
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1)
    assert mgr.latest().step == 1
    shared, _, _ = mgr.load(mgr.latest())
    assert _equal(shared, _state(1))


@pytest.mark.parametrize("victim", ["shared.pt", "rank0.pt", "manifest.json", "COMMITTED"])
def test_flipped_byte_is_detected_and_previous_used(tmp_path, victim):
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1, keep=3)
    _save(mgr, 1)
    _save(mgr, 2)
    newest = mgr.latest()
    _flip_byte(newest.path / victim, at=-5 if victim == "COMMITTED" else None)  # in its digest
    named = victim if victim != "COMMITTED" else ""
    with pytest.warns(UserWarning, match=f"snap-00000002.*{named}"):
        snap = mgr.latest()
    assert snap.step == 1
    if victim.endswith(".pt"):
        with pytest.raises(SnapshotCorruptError, match=f"{victim}: sha256"):
            mgr.load(newest)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without verify, only the manifest's own digest is checked
        expected = 1 if victim in ("manifest.json", "COMMITTED") else 2
        assert mgr.latest(verify=False).step == expected


def test_keep_last_k_and_same_step_replaced(tmp_path):
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1, keep=3)
    for step in range(0, 60, 10):
        _save(mgr, step)
    assert [s.step for s in mgr.snapshots()] == [50, 40, 30]
    _save(mgr, 50, seed=99)  # saved again after a restart: the newer state wins
    assert _equal(mgr.load(mgr.latest())[0], _state(99))
    assert sorted(os.listdir(tmp_path)) == ["snap-00000030", "snap-00000040", "snap-00000050"]


@pytest.mark.parametrize("background", [False, True])
def test_an_earlier_step_below_an_intact_later_snapshot_is_refused(tmp_path, background):
    """A run that went back by hand and saved step 15 beside 20: latest() (every resume) takes
    20, and with keep=1 the rotation removed 15 at once though its save said committed."""
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1, keep=1, background=background)
    _save(mgr, 20)
    mgr.wait()
    with pytest.raises(ValueError, match=r"step=15: .* holds a committed snapshot of a later step "
                                         r"\(snap-00000020\), which latest\(\), so every resume, "
                                         r"would take instead.*set the later snapshots aside first "
                                         r".*rewind\.set_aside_after"):
        _save(mgr, 15)
    assert [s.step for s in mgr.snapshots()] == [20]
    _save(mgr, 20, seed=7)  # the same step again replaces it, as after a restart
    mgr.wait()
    _flip_byte(mgr.latest().path / "shared.pt")  # a corrupt later one does not count: the
    _save(mgr, 15)  # trainer saves past a snapshot its resume skipped...
    mgr.wait()
    assert [s.step for s in mgr.snapshots()] == [15]  # ...and keep=1 rotates it out, not 15
    assert mgr.latest().step == 15
    mgr.close()
    two = SnapshotManager(tmp_path / "two", rank=0, world_size=1, keep=2)
    for step in (10, 20):
        _save(two, step)
    _flip_byte(two.latest().path / "rank0.pt")
    _save(two, 15)  # keep=2: 15 and the intact 10 stay, the corrupt later 20 goes first
    assert [s.step for s in two.snapshots()] == [15, 10]


def test_bad_arguments_fail_before_writing(tmp_path):
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1)
    with pytest.raises(TypeError, match="not JSON serializable"):
        mgr.save(1, shared={}, metadata={"f": object()})
    with pytest.raises(ValueError, match="metadata\\['world_size'\\]=4 but save has world_size=1"):
        mgr.save(1, shared={}, metadata={"world_size": 4})
    for step in (-1, 2.5, "3", True):  # a directory snap--0000001 was once written for -1
        with pytest.raises(ValueError, match=f"step={step!r}: a snapshot's step is an int >= 0"):
            mgr.save(step, shared={})
    with pytest.raises(TypeError, match="load\\(None\\): latest\\(\\) is None"):
        mgr.load(mgr.latest())
    assert mgr.latest() is None and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="keep=0"):
        SnapshotManager(tmp_path, rank=0, world_size=1, keep=0)
    with pytest.raises(ValueError,
                       match=r"Invalid rank 2, rank should be in the interval \[0, 1\]"):
        SnapshotManager(tmp_path, rank=2, world_size=2)


def test_check_topology_names_both_world_sizes():
    meta = {"step": 5, "world_size": 4, "topology": {"dp": 4}}
    assert check_topology(meta, 4, reshardable=False) is False
    assert check_topology(meta, 2, reshardable=True) is True
    with pytest.raises(SnapshotError, match="world_size=4 .* this run has world_size=2"):
        check_topology(meta, 2, reshardable=False)
    with pytest.raises(SnapshotError, match=r"\{'dp': 2, 'pp': 2\}"):
        check_topology(meta, 4, reshardable=False, topology={"dp": 2, "pp": 2})


class _Wrapper(nn.Module):  # what DDP looks like from the outside: the model under `.module`
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_module_prefix_accepted_either_way():
    plain = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    wrapped_sd = _Wrapper(plain).state_dict()
    assert all(k.startswith("module.") for k in wrapped_sd)
    assert list(unwrap_state_dict(wrapped_sd)) == list(plain.state_dict())
    for sd in (wrapped_sd, plain.state_dict()):
        for target in (nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)),
                       _Wrapper(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))):
            load_model_state_dict(target, sd)
            assert _equal(unwrap_state_dict(target.state_dict()), plain.state_dict())
    mixed = {"module.w": 1, "other": 2}  # a child merely named `module`: untouched
    assert unwrap_state_dict(mixed) is mixed


def _draw():
    return random.random(), np.random.rand(), np.random.randn(), torch.rand(3).tolist()


def test_rng_round_trip_reproduces_random_numbers(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state
    state = get_rng_state()
    expected = [_draw() for _ in range(3)]
    mgr = SnapshotManager(tmp_path, rank=0, world_size=1)
    mgr.save(1, per_rank={"rng": state})
    _, per_rank, _ = mgr.load(mgr.latest())  # through disk, weights_only=True
    set_rng_state(per_rank["rng"])
    assert [_draw() for _ in range(3)] == expected


def test_rng_missing_pieces_warn_by_name():
    state = get_rng_state()
    del state["numpy"]
    with pytest.warns(UserWarning, match="without numpy"):
        set_rng_state(state)
    with pytest.warns(UserWarning, match="no RNG state to restore"):
        set_rng_state(None)


# ---- multi-process: the bounded collective save ------------------------------------------------


class _SlowWhilePickled:
    """A disk that takes `s` seconds to write this object."""

    def __init__(self, s):
        self.s = s

    def __reduce__(self):
        time.sleep(self.s)
        return (int, (0,))


class _FailWhilePickled:
    def __reduce__(self):
        raise OSError(28, "No space left on device (simulated)")


def _collective_saves(rank, world_size, root, timeout_s):
    import torch.distributed as dist

    mgr = SnapshotManager(root, rank=rank, world_size=world_size, timeout_s=timeout_s)
    states = {step: _state(step) if rank == 0 else None for step in (1, 2, 3)}
    dist.barrier()  # the ranks reach save() together, so the deadlines measure the save itself
    ok = mgr.save(1, shared=states[1], per_rank={"rng": get_rng_state(), "rank": rank},
                  metadata={"topology": {"dp": 2}})
    outcomes = {}
    for step, bad in ((2, _FailWhilePickled()), (3, _SlowWhilePickled(1.5 * timeout_s))):
        dist.barrier()
        t = time.monotonic()
        try:
            mgr.save(step, shared=states[step],
                     per_rank={"rank": rank, "x": bad if rank == 1 else 0})
            outcomes[step] = ("committed", time.monotonic() - t)
        except SnapshotError as e:
            outcomes[step] = (str(e), time.monotonic() - t)
    dist.barrier()
    mgr.save(4, shared=states[1], per_rank={"rank": rank})
    if rank == 0:  # one rank's file is damaged: every rank must still pick the same snapshot
        _flip_byte(Path(root) / "snap-00000004" / "rank1.pt")
    dist.barrier()
    with pytest.warns(UserWarning, match="snap-00000004/rank1.pt: sha256"):
        snap = mgr.latest()
    shared, per_rank, meta = mgr.load(snap)
    return ok, outcomes, snap.step, per_rank["rank"], meta, shared["sampler"]


def test_two_rank_save_and_bounded_failures(tmp_path):
    timeout_s = 2.0
    results = run_workers(_collective_saves, 2, args=(str(tmp_path), timeout_s), timeout_s=60)
    for rank, (ok, outcomes, latest_step, loaded_rank, meta, sampler) in enumerate(results):
        assert ok.path == tmp_path / "snap-00000001" and ok.total_bytes == results[0][0].total_bytes
        assert (latest_step, loaded_rank) == (1, rank)  # failed saves and a corrupt one skipped
        assert meta == {"topology": {"dp": 2}, "step": 1, "world_size": 2}
        assert sampler == _state(1)["sampler"]
        failed, failed_s = outcomes[2]  # rank 1's write raised: both ranks raise, naming it, fast
        assert "rank 1 failed to write its part of snapshot step 2" in failed
        assert "No space left on device" in failed and failed_s < timeout_s
        slow, slow_s = outcomes[3]  # rank 1 too slow: both raise within the bound, naming it
        assert ("rank 1 did not finish" in slow or "ranks [1] did not finish" in slow), slow
        assert timeout_s * 0.9 < slow_s < timeout_s * 2, slow_s
    manifest = json.loads((tmp_path / "snap-00000001" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["rank0.pt", "rank1.pt", "shared.pt"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_round_trip_includes_cuda_once_initialised():
    torch.cuda.init()
    state = get_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda").tolist()
    set_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected
