"""A SIGKILL during a background write by the writer *process* (`ringtrain.checkpoint.writer`).

    .venv/bin/pytest -q tests/test_snapshot_writer_kill.py

test_async_snapshots.py kills a trainer whose writer *thread* is writing; here the files are
written by the long-lived writer process, and either side dies while it writes:
- the trainer (SIGKILL): the previous committed snapshot stays the newest, the temp directory is
  never taken for a snapshot, and the same run resumes from it to the uninterrupted run's bits;
- the writer process alone (the trainer survives): the save fails with the process's exit code
  (the previous snapshot stays the newest), and the next save starts a new process and commits.

The writer process is held inside its write by `_held_serve` (the process's loop, with a
`write_durably` that waits while a file named HOLD exists beside the snapshots directory and
says it entered by creating ENTERED): files, because the process is another interpreter, and
no sleep is the synchronisation (every wait is bounded by GATE_S).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import ringtrain.checkpoint.writer as writer
from ringtrain.checkpoint.snapshot import SnapshotError, SnapshotManager

GATE_S = 60  # a bound on every wait: nothing here should come near it
HOLD, ENTERED = "HOLD", "ENTERED"


def _held_serve(conn) -> None:
    """`writer._serve` in the writer process, its writes held while `<run dir>/HOLD` exists
    (run dir: the parent of the snapshots directory, two levels above the file)."""
    import ringtrain.checkpoint.files as files

    real = files.write_durably

    def write(path: Path, obj):
        run_dir = Path(path).parent.parent.parent
        if (run_dir / HOLD).exists():
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
        (tmp_path / HOLD).touch()
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
