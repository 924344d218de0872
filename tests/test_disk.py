"""A full or unusable run directory: one clear message, no leftovers, the last snapshot kept.

    .venv/bin/pytest -q tests/test_disk.py

The full-disk cases run on a small tmpfs mounted for the test and always unmounted after it
(root, or CAP_SYS_ADMIN); where `mount -t tmpfs` is not permitted they are skipped, saying so
(`make test` lists the reason, it runs pytest with -ra). Names that are new with these checks
are imported inside the tests, so that each test fails by itself on code without them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from ringtrain.checkpoint.snapshot import SnapshotError, SnapshotManager
from ringtrain.cli.train import main
from ringtrain.testing import run_workers
from ringtrain.training.progress import MetricsLog

# The command (`--steps 40 --snapshot-every 10`), shortened: the third save fails. Two
# steps between saves prove what ten did (two snapshots fit, the third does not; the rerun
# resumes from the last one and trains on) in a fifth of the steps, over four runs.
RUN = ["--steps", "6", "--snapshot-every", "2", "--eval-every", "2", "--no-progress",
       "--no-report"]
CLI_TIMEOUT_S = 240


@pytest.fixture()
def tmpfs(tmp_path):
    """`mount(size, read_only=False)` -> a fresh tmpfs directory; all unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        try:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"mount -t tmpfs is not permitted here ({e}): the full-disk cases need it")
        if proc.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here ({proc.stderr.strip()}): the "
                        "full-disk cases need it (run as root)")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in reversed(mounted):
            if subprocess.run(["umount", str(where)], capture_output=True, timeout=60).returncode:
                subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60)


def _fill(directory: Path) -> Path:
    """Fill the filesystem of `directory` to the last byte; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * (64 << 10)
        while True:
            try:
                if not f.write(chunk):
                    break
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                chunk = chunk[: len(chunk) // 2]
                if not chunk:
                    break
    return filler


def _cli(*args: str, cwd: Path) -> tuple[int, list[str]]:
    """`ringtrain train ARGS` in a subprocess: (exit code, lines of stdout + stderr)."""
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


def _no_traceback(lines: list[str]) -> None:
    assert not [x for x in lines if "Traceback" in x or "inline_container" in x], "\n".join(lines)


def _snapshots(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "snapshots").iterdir())


# ---- before any worker starts: one line, exit 2 -----------------------------------------------


@pytest.fixture()
def not_launched(monkeypatch):
    """`main()` in this process as a user's shell would run it: not a launched worker."""
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_unusable_run_dir_is_one_line_and_exit_2(tmp_path, capsys, not_launched, where):
    (tmp_path / "afile").write_text("not a directory")
    run_dir, expected = {
        "file": (tmp_path / "afile", "it is a file, not a directory"),
        "under_file": (tmp_path / "afile" / "sub",
                       f"{tmp_path / 'afile'} is a file, not a directory"),
        "proc": (Path("/proc/forbidden"), "cannot create it in /proc"),
    }[where]
    assert main([*RUN, "--run-dir", str(run_dir)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"ringtrain train: error: --run-dir {run_dir}: {expected}"), err
    assert "choose" in err


def test_read_only_run_dir_is_one_line_and_exit_2(tmpfs, capsys, not_launched):
    run_dir = tmpfs("1m", read_only=True)
    assert main([*RUN, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err == (f"ringtrain train: error: --run-dir {run_dir}: cannot write in it "
                   "(Read-only file system); choose a directory you can write to, "
                   "e.g. --run-dir runs/mine\n")


def test_full_run_dir_is_refused_naming_the_free_space(tmpfs, capsys, not_launched):
    disk = tmpfs("1m")
    _fill(disk)
    assert main([*RUN, "--run-dir", str(disk / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ringtrain train: error: no space left on device for --run-dir "
                          f"{disk / 'run'} (0.0 MB free of 1.0 MB; "
                          "a run needs at least 1.0 MB)"), err
    assert len(err.splitlines()) == 1


def test_unfinished_snapshot_folders_are_removed_at_the_next_start(tmp_path):
    from ringtrain.checkpoint.run_dir import check_run_dir

    snapshots = tmp_path / "run" / "snapshots"
    manager = SnapshotManager(snapshots, rank=0, world_size=1)
    manager.save(10, shared={"x": torch.zeros(100)}, per_rank={})
    stale = snapshots / ".tmp-snap-00000020-deadbeef"  # what a crash (or the old code) left
    stale.mkdir()
    (stale / "shared.pt").write_bytes(b"half a file")
    assert check_run_dir(tmp_path / "run") == [stale]
    assert _snapshots(tmp_path / "run") == ["snap-00000010"]
    assert manager.latest().step == 10


# ---- a disk that fills up --------------------------------------------------------------------


def test_snapshot_on_a_full_disk_raises_the_disk_error_and_leaves_no_temp_folder(tmpfs):
    from ringtrain.checkpoint.snapshot import SnapshotNoSpaceError

    root = tmpfs("1m") / "snapshots"
    manager = SnapshotManager(root, rank=0, world_size=1, keep=2)
    state = {"w": torch.arange(100_000, dtype=torch.float32)}  # 0.4 MB: a third does not fit
    for step in (1, 2):
        manager.save(step, shared=state, per_rank={"step": step})
    with pytest.raises(SnapshotNoSpaceError, match=r"rank 0 failed to write its part of snapshot "
                       r"step 3: OSError\(28, 'No space left on device'\)") as caught:
        manager.save(3, shared=state, per_rank={"step": 3})
    assert "inline_container" not in str(caught.value) and isinstance(caught.value, SnapshotError)
    assert sorted(os.listdir(root)) == ["snap-00000001", "snap-00000002"]
    assert manager.latest().step == 2 and manager.load(manager.latest())[1] == {"step": 2}


def test_metrics_log_on_a_full_disk_keeps_its_lines_and_never_raises(tmpfs, caplog):
    disk = tmpfs("1m")
    path = disk / "metrics.jsonl"
    log = MetricsLog(str(path))
    log.write({"step": 1, "loss": 2.0})
    filler = _fill(disk)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        for step in range(2, 400):
            log.write({"step": step, "loss": 1.0, "note": "x" * 100})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # once, not once per line
    assert warnings[0].startswith(f"warning: cannot write {path} (No space left on device; 0.0 MB "
                                  "free of 1.0 MB)"), warnings
    lines = path.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)  # no torn line
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, len(steps) + 1)) and len(log.unwritten) == 400 - 1 - len(steps)
    log.close()  # still full: no exception, the lines stay in `unwritten`
    assert log.unwritten and len(log.records) == 399
    # A resumed run on the full disk: cutting the file after its snapshot's step needs no space.
    resumed = MetricsLog(str(path), resume_at=2)
    assert [r["step"] for r in resumed.records] == [1, 2]
    filler.unlink()  # room again: the waiting lines go out, in order, once
    resumed.write({"step": 3, "loss": 0.5})
    resumed.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_cli_full_disk_stops_at_the_last_snapshot_then_resumes_once_there_is_room(tmpfs, tmp_path):
    disk = tmpfs("3m")  # the set-up: two snapshots of the default model fit, not three
    run_dir = disk / "run"
    code, lines = _cli(*RUN, "--run-dir", str(run_dir), cwd=tmp_path)
    assert code == 74, "\n".join(lines)
    _no_traceback(lines)
    errors = [x for x in lines if x.startswith("ringtrain")]
    assert len(errors) == 1, "\n".join(lines)
    assert errors[0].startswith(
        f"ringtrain train: error: no space left on device writing the snapshot of step 6 in "
        f"{run_dir}/snapshots ("), errors
    for part in (" MB free of 3.1 MB; a snapshot needs about 1.3 MB)",
                 "the last committed snapshot is step 4", "choose --run-dir elsewhere",
                 "run the same command again to resume"):
        assert part in errors[0], errors[0]
    assert _snapshots(run_dir) == ["snap-00000002", "snap-00000004"]  # no .tmp-snap-* left
    # The same command again: refused at once, naming the space the next snapshot needs.
    code, lines = _cli(*RUN, "--run-dir", str(run_dir), cwd=tmp_path)
    assert code == 2 and len(lines) == 1, "\n".join(lines)
    assert "MB free of 3.1 MB; its next snapshot needs about 1.3 MB" in lines[0], lines
    # Room made (the tmpfs grown): the same command resumes from step 4 and finishes.
    subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True, timeout=30)
    code, lines = _cli(*RUN, "--run-dir", str(run_dir), cwd=tmp_path)
    assert code == 0, "\n".join(lines)
    assert any("resumed from" in x and "step 4 of 6" in x for x in lines), "\n".join(lines)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_cli_two_processes_full_disk_stop_together_with_one_message(tmpfs, tmp_path):
    run_dir = tmpfs("3m") / "run"
    code, lines = _cli(*RUN, "--nproc-per-node", "2", "--run-dir", str(run_dir), cwd=tmp_path)
    assert code == 74, "\n".join(lines)
    _no_traceback(lines)
    errors = [x for x in lines if x.startswith("ringtrain")]  # no launcher report besides
    assert len(errors) == 1, "\n".join(lines)
    assert "no space left on device writing the snapshot of step 6" in errors[0], errors
    assert "the last committed snapshot is step 4" in errors[0], errors
    assert _snapshots(run_dir) == ["snap-00000002", "snap-00000004"]


# ---- every rank learns the save failed, and why ------------------------------------------------


class _FailsWhilePickled:
    def __init__(self, code: int):
        self.code = code

    def __reduce__(self):
        raise OSError(self.code, os.strerror(self.code))


def _mixed_failures(rank, world_size, root):
    from ringtrain.checkpoint.snapshot import SnapshotNoSpaceError

    manager = SnapshotManager(root, rank=rank, world_size=world_size, timeout_s=20)
    manager.save(1, shared={"x": 1}, per_rank={"rank": rank})
    kinds = []
    # (rank 0's error, rank 1's error): a full disk on either rank stops both; EIO alone does not.
    for step, codes in ((2, (None, errno.ENOSPC)), (3, (errno.EIO, errno.ENOSPC)),
                        (4, (None, errno.EIO))):
        bad = codes[rank]
        try:
            manager.save(step, shared={"x": 1},
                         per_rank={"x": _FailsWhilePickled(bad) if bad else 0})
            kinds.append("committed")
        except SnapshotNoSpaceError:
            kinds.append("no space")
        except SnapshotError:
            kinds.append("other")
    return kinds, sorted(os.listdir(root))


def test_every_rank_raises_the_same_kind_of_save_failure(tmp_path):
    results = run_workers(_mixed_failures, 2, args=(str(tmp_path),), timeout_s=90)
    for kinds, listing in results:
        assert kinds == ["no space", "no space", "other"]
        assert listing == ["snap-00000001"]  # every failed save's temp folder removed


# ---- the end of a run: rank 0 alone writes summary.json --------------------------------------


def test_full_disk_at_the_end_is_a_message_not_a_traceback(tmpfs, monkeypatch):
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.launch.process_group import destroy_distributed, init_distributed
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr("ringtrain.training.report.write_report", lambda *args, **kwargs: None)
    disk = tmpfs("1m")
    rt = init_distributed()
    try:
        model = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16)
        cfg = TrainerConfig(steps=6, batch_size=8, seed=0, progress=False, log_every=1,
                            eval_every=6)
        trainer = Trainer(make_strategy("ddp", runtime=rt), rt, lambda: GPT(model),
                          AdditionDataset("train", 1), Subset(AdditionDataset("test", 1), range(5)),
                          loss_fn, cfg, run_dir=str(disk / "run"), snapshot_every=0)
        trainer.on_step = lambda step: _fill(disk) if step == 3 else None
        summary = trainer.fit()  # before: an OSError 28 traceback writing summary.json
    finally:
        destroy_distributed()
    assert summary["steps"] == 6 and summary["param_sha256"]
    assert summary["disk_full"].startswith(
        f"no space left on device writing summary.json and report.png in {disk / 'run'} (0.0 MB "
        "free of 1.0 MB); no snapshot was committed"), summary["disk_full"]
    assert not list((disk / "run").glob("summary.json*.tmp"))
    lines = (disk / "run" / "metrics.jsonl").read_text().splitlines()  # whole lines, in order
    assert [json.loads(x)["step"] for x in lines] == list(range(1, len(lines) + 1))
