"""Snapshots saved in the background (`ringtrain.checkpoint.background`, the trainer's default).

    .venv/bin/pytest -q tests/test_async_snapshots.py

CPU, gloo, one process unless a test says otherwise. The writer is held at a gate (a patched
`write_durably` that waits for an event) where a test needs the write to be still under way:
no sleeps as synchronisation. What the background keeps from the synchronous save is tested
where the synchronous save is: test_resume.py (two ranks: exact resume, a torn part, a SIGTERM
stop) and test_disk.py (a full disk stops every rank at the last committed snapshot) run with
the default, the background.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

import ringtrain.checkpoint.snapshot as snapshot
from ringtrain.checkpoint.host_copy import HostCopy
from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.testing import WorkerError, run_workers

GATE_S = 60  # a bound on every wait for the gated writer: nothing here should come near it


@pytest.fixture()
def gate(monkeypatch):
    """`gate(step)`: the writer of that step's files waits until `gate.open.set()`."""
    real = snapshot.write_durably
    held = {"step": None}
    opened, entered = threading.Event(), threading.Event()

    def write(path: Path, obj):
        if held["step"] is not None and f"-{held['step']:08d}-" in path.parent.name:
            entered.set()
            assert opened.wait(GATE_S), "the test never opened the gate"
        return real(path, obj)

    def hold(step: int):
        held["step"] = step
    monkeypatch.setattr(snapshot, "write_durably", write)
    hold.open, hold.entered = opened, entered
    return hold


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.register_buffer("head", model[0].weight.detach()[2:4])  # a view of a parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # state: momentum buffers
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


# ---- the host copy -----------------------------------------------------------------------------


def test_host_copy_is_what_torch_save_writes_and_keeps_views_and_sharing():
    model, opt = _model_and_optimizer()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
             "pair": (torch.ones(2), [torch.zeros(1)])}
    host = HostCopy()
    staged = host.copy(state).state  # nothing deferred: copied before copy() returns
    a, b = staged["model"]["0.weight"], staged["model"]["head"]
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # still shared
    assert (b.storage_offset(), b.stride()) == (16, a.stride()) and torch.equal(b, a[2:4])
    assert staged["model"]._metadata == state["model"]._metadata  # load_state_dict reads it
    assert staged["step"] == 3 and isinstance(staged["pair"], tuple)

    saved = _saved_bytes
    assert saved(staged) == saved(state)
    # The optimizer's next step changes parameters and moments in place: not the copy.
    before = saved(staged)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert saved(staged) == before != saved(state)
    # The next copy reuses the buffers: no allocation once the storages are known.
    again = host.copy(state).state
    assert again["model"]["0.weight"].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def _saved_bytes(obj) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_copy_beside_the_next_step_holds_the_snapshot_steps_state_and_gates_the_optimizer():
    """CPU. The rule: parameters and moments (declared) are copied beside the next forward and
    backward, the optimizer's next step waits for that copy; a buffer the forward changes in
    place (BatchNorm's running stats) is copied in the snapshot's step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    expected = _saved_bytes(state)  # what a synchronous save at this step writes
    moments = [t for s in opt.state.values() for t in s.values()]
    host = HostCopy()
    staged = host.copy(state, later=[*model.parameters(), *moments])
    staged.guard([opt])
    assert staged.later_bytes == sum(t.untyped_storage().nbytes()
                                     for t in [*model.parameters(), *moments])
    model(torch.randn(4, 8)).sum().backward()  # the next step's forward and backward ...
    assert _saved_bytes(state) != expected  # ... changed the running stats in place
    stepped = threading.Thread(target=opt.step)  # ... and its optimizer step must wait
    stepped.start()
    stepped.join(0.3)
    assert stepped.is_alive(), "the optimizer stepped before the copy landed"
    staged.finish()  # the writer thread's first act
    stepped.join(GATE_S)
    assert not stepped.is_alive() and staged.overlap_s >= 0
    staged.unguard()
    assert not opt._optimizer_step_pre_hooks  # noqa: SLF001 - the hook is gone once joined
    assert _saved_bytes(staged.state) == expected  # byte for byte the snapshot step's state
    # The buffers `finish` allocated (off the step) are the next copy's, views and all.
    again = host.copy(state, later=[*model.parameters(), *moments])
    again.finish()
    ptr = staged.state["model"]["0.weight"].untyped_storage().data_ptr()
    assert again.state["model"]["0.weight"].untyped_storage().data_ptr() == ptr


def test_a_writer_process_writes_what_the_thread_writes(tmp_path):
    """CPU. The process writer (`writer.py`): the same files as a synchronous save, from shared
    memory; a failure in the process comes back as the OSError it was."""
    from ringtrain.checkpoint.writer import WriterProcess

    model, opt = _model_and_optimizer()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    sync = SnapshotManager(tmp_path / "sync", rank=0, world_size=1)
    sync.save(1, shared=state, per_rank={"step": 1})
    manager = SnapshotManager(tmp_path / "process", rank=0, world_size=1)
    manager.background, manager.background_saves.writer = True, "process"
    manager.save(1, shared=state, per_rank={"step": 1})
    assert manager.wait().committed
    files = {n: f["sha256"] for n, f in manager.latest().manifest["files"].items()}
    assert files == {n: f["sha256"] for n, f in sync.latest().manifest["files"].items()}
    write = manager.background_saves.write_file()
    with pytest.raises(FileNotFoundError, match="No such file"):
        write(tmp_path / "missing" / "x.pt", {"x": 1})
    if Path("/dev/full").exists():  # a full disk: errno ENOSPC survives the trip back
        with pytest.raises(OSError) as full:
            write(Path("/dev/full"), {"x": torch.zeros(1 << 16)})
        assert snapshot.save_error("x", full.value).__class__ is snapshot.SnapshotNoSpaceError
    writer = WriterProcess()
    writer.close()  # never started: nothing to stop
    manager.close()
    assert manager.background_saves._process is None  # noqa: SLF001


# ---- the manager in the background --------------------------------------------------------------


def test_background_save_returns_before_the_write_and_commits_what_the_step_had(tmp_path, gate):
    model, opt = _model_and_optimizer()
    sync = SnapshotManager(tmp_path / "sync", rank=0, world_size=1)
    sync.save(1, shared={"model": model.state_dict(), "optimizer": opt.state_dict()},
              per_rank={"step": 1})
    manager = SnapshotManager(tmp_path / "bg", rank=0, world_size=1)
    manager.background = True
    gate(1)
    result = manager.save(1, shared={"model": model.state_dict(), "optimizer": opt.state_dict()},
                          per_rank={"step": 1})
    assert not result.committed and gate.entered.wait(GATE_S)
    assert manager.writing and manager.in_flight == 1 and manager.latest() is None
    model(torch.randn(4, 8)).sum().backward()  # the loop goes on while the writer is held
    opt.step()
    gate.open.set()
    done = manager.wait()
    assert done.committed and done.step == 1 and not manager.writing
    assert manager.wait() is None  # joined once
    # Byte for byte the synchronous save of the same state, taken before the optimizer moved.
    files = {n: f["sha256"] for n, f in manager.latest().manifest["files"].items()}
    assert files == {n: f["sha256"] for n, f in sync.latest().manifest["files"].items()}


def test_at_most_one_save_in_flight_and_a_failure_raised_once(tmp_path, gate):
    manager = SnapshotManager(tmp_path, rank=0, world_size=1)
    manager.background = True
    gate(1)
    manager.save(1, shared={"x": torch.zeros(3)}, per_rank={})
    assert gate.entered.wait(GATE_S)
    threading.Timer(0.2, gate.open.set).start()  # the second save must wait for the first
    manager.save(2, shared={"x": torch.ones(3)}, per_rank={})
    assert [s.step for s in manager.snapshots()] == [1]  # 1 committed before 2 was copied
    manager.wait()
    assert [s.step for s in manager.snapshots()] == [2, 1]
    # A failure in the writer comes out of wait(), once, as the foreground save raises it.
    manager.save(3, shared={"x": _Unpicklable()}, per_rank={})
    with pytest.raises(snapshot.SnapshotError, match="rank 0 failed to write its part of "
                       "snapshot step 3"):
        manager.wait()
    assert manager.wait() is None and manager.latest().step == 2


@pytest.mark.parametrize("background", [True, False])
def test_a_save_in_halves_writes_what_one_call_writes(tmp_path, background):
    """`stage` then `StagedSave.save` (the trainer's order around its metrics line): the same
    files as one `save` of the merged state; a key in both halves, or a second save, refused."""
    from ringtrain.strategies.base import UpdatedState

    model, opt = _model_and_optimizer()
    one = SnapshotManager(tmp_path / "one", rank=0, world_size=1)
    halves = SnapshotManager(tmp_path / "halves", rank=0, world_size=1)
    one.background = halves.background = background
    loop = {"step": 1, "window": {"loss_sum": 2.5}}
    one.save(1, shared={"strategy": {"model": model.state_dict()}, "trainer": loop},
             per_rank={"rng": torch.arange(3), "step": 1}, metadata={"reason": "x"})
    updated = UpdatedState(list(model.parameters()), [opt])
    staged = halves.stage(1, {"strategy": {"model": model.state_dict()}},
                          {"rng": torch.arange(3)}, updated=updated)
    staged.save({"reason": "x"}, shared={"trainer": loop}, per_rank={"step": 1})
    loop["step"] = 2  # the caller's dicts are its own again once `save` returned
    one.wait(), halves.wait()
    files = {n: f["sha256"] for n, f in halves.latest().manifest["files"].items()}
    assert files == {n: f["sha256"] for n, f in one.latest().manifest["files"].items()}
    with pytest.raises(RuntimeError, match="step 1 was saved or dropped already"):
        staged.save()
    twice = halves.stage(2, {"trainer": {}})
    with pytest.raises(ValueError, match=r"shared keys \['trainer'\] given in both halves"):
        twice.save(shared={"trainer": loop})


def test_a_dropped_staged_save_lets_the_optimizer_step(tmp_path):
    """A save staged and then dropped (the loop stopped early at its step): nothing is
    written, and the optimizer, which the copy's guard held, steps at once."""
    from ringtrain.strategies.base import UpdatedState

    model, opt = _model_and_optimizer()
    manager = SnapshotManager(tmp_path, rank=0, world_size=1)
    manager.background = True
    staged = manager.stage(1, {"model": model.state_dict()},
                           updated=UpdatedState(list(model.parameters()), [opt]))
    assert opt._optimizer_step_pre_hooks  # noqa: SLF001 - guarded until the copy lands
    staged.drop()
    assert not opt._optimizer_step_pre_hooks  # noqa: SLF001
    stepped = threading.Thread(target=opt.step)
    stepped.start()
    stepped.join(GATE_S)
    assert not stepped.is_alive(), "the optimizer waited for a copy that was dropped"
    assert manager.wait() is None and manager.latest() is None
    manager.save(2, shared={"model": model.state_dict()})  # the next save as any
    assert manager.wait().step == 2


class _Unpicklable:
    def __reduce__(self):
        raise OSError(5, "Input/output error")


# ---- through the trainer -----------------------------------------------------------------------


def _trainer(run_dir, *, steps=6, every=2, sync=False, on_step=None):
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.runtime import get_runtime
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    rt = get_runtime()
    model = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    cfg = TrainerConfig(steps=steps, batch_size=8, seed=0, progress=False, log_every=1,
                        eval_every=steps)
    trainer = Trainer(make_strategy("ddp", runtime=rt), rt, lambda: GPT(model),
                      AdditionDataset("train", 1), Subset(AdditionDataset("test", 1), range(5)),
                      loss_fn, cfg, run_dir=str(run_dir), snapshot_every=every,
                      sync_snapshots=sync)
    trainer.on_step = on_step
    return trainer


@pytest.fixture()
def one_rank(monkeypatch):
    """A process group of this process alone (gloo, CPU, one thread as `run_workers` gives its
    workers, so that a run here and one in a worker give the same bits), destroyed after."""
    from ringtrain.launch.process_group import destroy_distributed, init_distributed

    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr("ringtrain.training.report.write_report", lambda *a, **k: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_distributed()
    try:
        yield
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)


def _saved(run_dir: Path) -> dict[str, tuple[list, str]]:
    """Each snapshot's model and optimizer state, flattened, and rank 0's file checksum.

    shared.pt's own bytes differ from run to run: the loop's totals hold wall-clock times.
    """
    def flat(obj, path=""):
        if isinstance(obj, dict):
            return [x for k, v in obj.items() for x in flat(v, f"{path}/{k}")]
        if isinstance(obj, list | tuple):
            return [x for i, v in enumerate(obj) for x in flat(v, f"{path}[{i}]")]
        if isinstance(obj, torch.Tensor):  # the bits, and the dtype and shape with them
            return [(path, obj.dtype, tuple(obj.shape), obj.numpy().tobytes())]
        return [(path, obj)]

    manager = SnapshotManager(run_dir / "snapshots", rank=0, world_size=1)
    return {snap.path.name: (flat(manager.load(snap)[0]["strategy"]),
                             snap.manifest["files"]["rank0.pt"]["sha256"])
            for snap in manager.snapshots()}


_REFERENCE: dict[str, str] = {}  # the uninterrupted run's param_sha256, made once per session


def _reference_sha(run_dir: Path) -> str:
    if "sha" not in _REFERENCE:
        _REFERENCE["sha"] = _trainer(run_dir, sync=True).fit()["param_sha256"]
    return _REFERENCE["sha"]


def test_background_and_sync_snapshots_write_the_same_files(tmp_path, one_rank, gate, caplog):
    _REFERENCE.pop("sha", None)  # this test's sync run is the reference: run it here
    sync = {"param_sha256": _reference_sha(tmp_path / "sync")}
    gate(2)  # the writer of step 2 is held until step 4's save: the step waits, and says so once
    opened = threading.Timer(1.5, gate.open.set)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        trainer = _trainer(tmp_path / "bg", on_step=lambda s: opened.start() if s == 3 else None)
        background = trainer.fit()
    assert background["param_sha256"] == sync["param_sha256"]
    saved = _saved(tmp_path / "bg")
    assert list(saved) == ["snap-00000006", "snap-00000004"]  # keep 2
    assert saved == _saved(tmp_path / "sync")
    waited = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waited) == 1 and waited[0].startswith(
        "warning: the snapshot of step 4 waited"), waited


def test_the_trainer_stages_a_snapshot_before_its_metrics_line(tmp_path, one_rank,
                                                               monkeypatch):
    """At a step that logs and saves, the save's copies come before the metrics line (which
    waits for the device: the host copies while a GPU trains); the loop's state saved is the
    one the line left (its window emptied). An early stop at a snapshot step saves it once its
    line decided the stop (a resume finds the stop there), and leaves the optimizer unguarded."""
    from ringtrain.checkpoint.loop_save import LoopSave
    from ringtrain.training.snapshots import LoopSnapshots
    from ringtrain.training.trainer import Trainer

    calls = []

    def recorded(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call
    for cls, name in ((LoopSnapshots, "stage"), (Trainer, "_log"), (LoopSave, "save")):
        monkeypatch.setattr(cls, name, recorded(name, getattr(cls, name)))
    trainer = _trainer(tmp_path / "run", steps=4, every=2)
    trainer.fit()
    assert calls == ["_log", "stage", "_log", "save"] * 2, calls
    saved = SnapshotManager(tmp_path / "run" / "snapshots", rank=0, world_size=1)
    shared, per_rank, _ = saved.load(saved.latest())
    assert per_rank["window_steps"] == 0 and per_rank["window"]["count"] == 0
    assert shared["trainer"]["last"]["step"] == 4  # the line of the snapshot's own step

    calls.clear()
    early = _trainer(tmp_path / "early", steps=6, every=2)
    early.config = dataclasses.replace(early.config, eval_every=2)
    early.stop_when = lambda rec: rec["step"] == 4
    assert early.fit()["steps"] == 4
    assert calls == ["_log", "stage", "_log", "save", "_log", "stage", "_log", "save"], calls
    early_saved = SnapshotManager(tmp_path / "early" / "snapshots", rank=0, world_size=1)
    assert [s.step for s in early_saved.snapshots()] == [4, 2]
    assert early_saved.latest().metadata["reason"] == "early stop"
    assert not early.strategy.optimizer._optimizer_step_pre_hooks  # noqa: SLF001


def _killed_while_writing(rank, world_size, run_dir):
    """Snapshots every 2 steps; the writer of step 4 never finishes; SIGKILL after step 5."""
    import os
    import signal
    import threading
    import time

    real = snapshot.write_durably
    writing = threading.Event()

    def write(path, obj):
        if "-00000004-" in path.parent.name:
            writing.set()
            time.sleep(GATE_S)  # a slow disk: the kill comes first
        return real(path, obj)
    snapshot.write_durably = write
    import ringtrain.training.report
    ringtrain.training.report.write_report = lambda *a, **k: None

    def on_step(step):
        if step == 5:
            # During the write: under load the writer thread may not have begun by step 5.
            assert writing.wait(60), "the background write of step 4 never began"
            os.kill(os.getpid(), signal.SIGKILL)
    _trainer(run_dir, on_step=on_step).fit()


def test_a_kill_during_the_background_write_leaves_the_previous_snapshot(tmp_path, one_rank):
    run_dir = tmp_path / "killed"
    with pytest.raises(WorkerError, match="exited with code -9"):
        run_workers(_killed_while_writing, 1, args=(str(run_dir),), timeout_s=90)
    left = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert left[0].startswith(".tmp-snap-00000004-") and left[1:] == ["snap-00000002"], left
    assert SnapshotManager(run_dir / "snapshots", rank=0, world_size=1).latest().step == 2
    # The same run again resumes from step 2 and ends where an uninterrupted run ends.
    resumed = _trainer(run_dir).fit()
    assert resumed["param_sha256"] == _reference_sha(tmp_path / "reference")
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["snap-00000004",
                                                                        "snap-00000006"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned copies)")
def test_host_copy_from_cuda_is_pinned_and_ready_after_the_event():
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copied = HostCopy().copy({"t": t, "v": t[10:20]})
    t.add_(1)  # queued after the copy on the same stream: the copy has the old values
    copied.finish()
    staged = copied.state
    assert staged["t"].is_pinned() and staged["t"].device.type == "cpu"
    assert torch.equal(staged["t"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(staged["v"], staged["t"][10:20])


def _cpu_bytes(obj) -> bytes:
    """What `torch.save` writes for `obj` with every storage on the CPU (as a host copy has it):
    saved, loaded to the CPU (sharing, views and a state_dict's `_metadata` kept), saved again."""
    import io
    return _saved_bytes(torch.load(io.BytesIO(_saved_bytes(obj)), map_location="cpu",
                                   weights_only=False))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                "(device staging, pinned copies, a side stream)")


@needs_cuda
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per_tensor"])
def test_staged_copy_from_cuda_is_the_snapshot_steps_state_byte_for_byte(caplog, batched):
    """CUDA, room to stage. Parameters and moments are copied on the device in the step, then
    to the host by `finish`; the next step's optimizer (nothing fenced) and forward (running
    stats) change the sources in place before `finish` runs: the copy is what `torch.save`
    wrote at the snapshot's step, byte for byte, and the next save reuses every buffer. Batched
    (torch's foreach copy: a call per pair of devices) or one copy call per storage alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(16, 64, device="cuda")).sum().backward()
        opt.step()

    def later():
        moments = [t for s in opt.state.values() for t in s.values() if t.is_cuda]
        return [*model.parameters(), *moments]
    step()
    host = HostCopy(batched=batched)
    saves = []
    for _ in range(2):
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        expected = _cpu_bytes(state)  # what a synchronous save at this step writes
        with caplog.at_level(logging.INFO, logger="ringtrain"):
            staged = host.copy(state, later=later())
        staged.guard([opt])
        assert staged.path.startswith("from a copy on cuda"), staged.path
        assert not staged._side_events  # noqa: SLF001 - nothing for the optimizer to wait for
        assert staged.later_bytes == sum(t.untyped_storage().nbytes() for t in later())
        step()  # changes parameters, moments and running stats in place, before `finish`
        assert _cpu_bytes(state) != expected
        staged.finish()
        staged.unguard()
        assert _saved_bytes(staged.state) == expected
        assert staged.state["model"]["0.weight"].is_pinned()
        saves.append(staged)
    # 12 deferred storages (4 parameters, 8 moments), each copied in the step and in `finish`;
    # batched, at most a call per pair of devices in the step (3) and one in `finish`.
    assert host.copy_calls <= 2 * 4 if batched else host.copy_calls >= 2 * 2 * 12
    ptr = [s.state["model"]["0.weight"].untyped_storage().data_ptr() for s in saves]
    assert ptr[0] == ptr[1]  # the host buffers `finish` allocated are the next save's
    assert host._staging.held_bytes == saves[0].later_bytes  # noqa: SLF001 - kept, once
    said = [r.getMessage() for r in caplog.records if "staged by a copy" in r.getMessage()]
    assert len(said) == 1 and "kept from save to save" in said[0], said


@needs_cuda
def test_host_copy_from_cuda_without_room_to_stage_fences_a_side_stream(monkeypatch, caplog):
    """CUDA, `mem_get_info` patched. One byte short of the margin (twice the deferred bytes +
    1 GiB), the deferred copy runs on a side stream and `fence()` makes the current stream wait
    for it, so a kernel queued after the fence (the optimizer's) cannot reach the copy. With the
    margin it is staged (buffers kept); short again, the buffers are freed."""
    from ringtrain.checkpoint.device_staging import MARGIN_BYTES

    t = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    buffer = torch.zeros(4, device="cuda")
    want = 2 * t.untyped_storage().nbytes() + MARGIN_BYTES
    free = {"bytes": want - 1}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    host = HostCopy()
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        staged = host.copy({"t": t, "buffer": buffer}, later=[t])
        assert staged.path.startswith("on a side stream"), staged.path
        assert staged._side_events  # noqa: SLF001 - the optimizer's fence
        buffer.add_(1)  # a forward's in-place change: the buffer was copied before it
        staged.fence()
        t.mul_(0)  # the optimizer's step, queued after the fence
        staged.finish()
        assert staged.state["t"].is_pinned() and staged.later_bytes == t.numel() * 4
        assert torch.equal(staged.state["t"], torch.arange(1 << 22, dtype=torch.float32))
        assert torch.equal(staged.state["buffer"], torch.zeros(4))
        assert host._staging.held_bytes == 0  # noqa: SLF001

        free["bytes"] = want  # the margin exactly: staged
        t.copy_(torch.arange(1 << 22, dtype=torch.float32, device="cuda"))
        staged = host.copy({"t": t}, later=[t])
        assert staged.path.startswith("from a copy on cuda"), staged.path
        t.mul_(0)  # the next optimizer step, not fenced: the staging copy came before it
        staged.finish()
        assert torch.equal(staged.state["t"], torch.arange(1 << 22, dtype=torch.float32))
        assert host._staging.held_bytes == t.untyped_storage().nbytes()  # noqa: SLF001

        free["bytes"] = want - 1 - t.untyped_storage().nbytes()  # short, counting what it holds
        staged = host.copy({"t": t}, later=[t])
        assert staged.path.startswith("on a side stream"), staged.path
        staged.fence()
        staged.finish()
        assert host._staging.held_bytes == 0  # noqa: SLF001 - freed
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("snapshots on")]
    assert len(said) == 3 and "no device staging" in said[0] and "stopped" in said[2], said
