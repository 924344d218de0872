"""A SIGKILL during a background write by the writer *process* (`ringtrain.checkpoint.writer`).

    .venv/bin/pytest -q tests/test_snapshot_writer_kill.py

test_async_snapshots.py kills a trainer whose writer *thread* is writing; here the files are
written by the long-lived writer process, and either side dies while it writes:
- the trainer (SIGKILL): the previous committed snapshot stays the newest, the temp directory is
  never taken for a snapshot, and the same run resumes from it to the uninterrupted run's bits;
- the writer process alone (the trainer survives): the save fails with the process's exit code
  (the previous snapshot stays the newest), and the next save starts a new process and commits.

The writer process is held inside its write by `_held_serve` (the process's loop, with a
`write_durably` that holds the write of step N while a file named HOLD, holding N, exists
beside the snapshots directory, and says it entered by creating ENTERED): files, because the
process is another interpreter, and no sleep is the synchronisation (each wait bounded by GATE_S).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from test_async_snapshots import _reference_sha, _trainer, one_rank  # noqa: F401 - a fixture

import ringtrain.checkpoint.writer as writer
from ringtrain.checkpoint.snapshot import SnapshotError, SnapshotManager
from ringtrain.testing import WorkerError, run_workers

GATE_S = 60  # a bound on every wait: nothing here should come near it
HOLD, ENTERED = "HOLD", "ENTERED"


def _held_serve(conn) -> None:
    """`writer._serve` in the writer process, its writes of step N held while `<run dir>/HOLD`
    (holding N) exists (run dir: the parent of the snapshots directory)."""
    import ringtrain.checkpoint.files as files

    real = files.write_durably

    def write(path: Path, obj):
        run_dir = Path(path).parent.parent.parent
        hold = run_dir / HOLD
        if hold.exists() and f"-{int(hold.read_text()):08d}-" in Path(path).parent.name:
            (run_dir / ENTERED).touch()
            deadline = time.monotonic() + GATE_S
            while (run_dir / HOLD).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return real(path, obj)
    files.write_durably = write  # `_serve` imports it at its start, after this
    writer._serve(conn)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + GATE_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_writer_process_killed_alone_fails_that_save_and_the_next_commits(tmp_path,
                                                                           monkeypatch):
    """In-process trainer side. The process is SIGKILLed inside its write: `wait()` raises
    SnapshotError naming its exit code (-9), step 1 stays the newest, no temp directory is
    taken for a snapshot, and the next save starts a new process and commits."""
    monkeypatch.setattr(writer, "_serve", _held_serve)
    root = tmp_path / "snapshots"
    manager = SnapshotManager(root, rank=0, world_size=1, timeout_s=GATE_S)
    manager.background, manager.background_saves.writer = True, "process"
    state = {"w": torch.arange(8.0)}
    try:
        manager.save(1, shared=state, per_rank={"step": 1})
        assert manager.wait().committed
        (tmp_path / HOLD).write_text("2")
        manager.save(2, shared={"w": state["w"] + 1}, per_rank={"step": 2})
        _wait_for(tmp_path / ENTERED)
        os.kill(manager.background_saves._process._process.pid, signal.SIGKILL)  # noqa: SLF001
        with pytest.raises(SnapshotError, match=r"writer process ended \(exit code -9\)"):
            manager.wait()
        assert [s.step for s in manager.snapshots()] == [1]
        assert manager.latest().step == 1
        (tmp_path / HOLD).unlink()
        manager.save(3, shared={"w": state["w"] + 3}, per_rank={"step": 3})
        assert manager.wait().committed
        assert [s.step for s in manager.snapshots()] == [3, 1]
        assert torch.equal(manager.load(manager.latest())[0]["w"], state["w"] + 3)
    finally:
        (tmp_path / HOLD).unlink(missing_ok=True)
        manager.close()


def _killed_while_the_process_writes(rank, world_size, run_dir):
    """Snapshots every 2 steps, written by the writer process; its write of step 4 is held;
    the trainer SIGKILLs itself after step 5 (the process is still inside that write)."""
    import ringtrain.training.report

    ringtrain.training.report.write_report = lambda *a, **k: None
    # run_workers' workers are multiprocessing daemons, which may start no process (the
    # manager would fall back to the thread); the launcher's workers are plain processes.
    import multiprocessing

    multiprocessing.current_process().daemon = False
    writer._serve = _held_serve
    run_dir = Path(run_dir)

    def on_step(step):
        if step == 3:
            (run_dir / HOLD).write_text("4")  # before step 4's save: its write is held
        if step == 5:
            _wait_for(run_dir / ENTERED)
            os.kill(os.getpid(), signal.SIGKILL)
    trainer = _trainer(run_dir, on_step=on_step)
    trainer.snapshots.manager.background_saves.writer = "process"
    trainer.fit()


def test_a_kill_during_the_writer_process_write_leaves_the_previous_snapshot(tmp_path,
                                                                            one_rank):  # noqa: F811
    run_dir = tmp_path / "killed"
    with pytest.raises(WorkerError, match="exited with code -9"):
        run_workers(_killed_while_the_process_writes, 1, args=(str(run_dir),), timeout_s=90)
    left = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert left[0].startswith(".tmp-snap-00000004-") and left[1:] == ["snap-00000002"], left
    assert SnapshotManager(run_dir / "snapshots", rank=0, world_size=1).latest().step == 2
    (run_dir / HOLD).unlink()  # the orphaned process may end its file, in the temp directory
    resumed = _trainer(run_dir).fit()
    assert resumed["param_sha256"] == _reference_sha(tmp_path / "reference")
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["snap-00000004",
                                                                        "snap-00000006"]


def test_where_no_writer_process_can_start_the_thread_writes(tmp_path, monkeypatch, caplog):
    """A multiprocessing daemon (as run_workers' workers) can start no process: the save is
    written by the thread (committed, said once), not failed at every snapshot."""
    def refuse(self):
        raise writer.CannotStartWriter("the snapshot writer process cannot start here")
    monkeypatch.setattr(writer.WriterProcess, "start", refuse)
    manager = SnapshotManager(tmp_path / "snapshots", rank=0, world_size=1)
    manager.background, manager.background_saves.writer = True, "process"
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        for step in (1, 2):
            manager.save(step, shared={"w": torch.full((4,), float(step))},
                         per_rank={"step": step})
            assert manager.wait().committed
    manager.close()
    said = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert len(said) == 1 and "the writer thread writes" in said[0], said
    assert manager.background_saves.using == "thread"
    assert torch.equal(manager.load(manager.latest())[0]["w"], torch.full((4,), 2.0))
