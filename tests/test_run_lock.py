"""One run per run directory (`ringtrain.checkpoint.run_lock`): a second `ringtrain train` in a
--run-dir that a running job holds is one message naming that job, and writes nothing there.

    .venv/bin/pytest -q tests/test_run_lock.py

In this process: a flock belongs to an open file, so a lock taken here stands for another run.
Two ranks: tests/test_train_cli.py (rank 0 holds it). CPU and gloo (tests/conftest.py sets the
device for every test not marked cuda).
"""

from __future__ import annotations

import os

import pytest

from ringtrain.checkpoint.run_lock import (
    LOCK,
    RunDirInUse,
    hold_run_dir,
    holder,
    release_run_dir,
)
from ringtrain.cli.explain import explain, load_run
from ringtrain.cli.train import main

pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace

TINY = ["--steps", "2", "--snapshot-every", "1", "--n-layer", "1", "--n-embd", "32",
        "--batch-size", "16", "--eval-every", "2", "--no-progress", "--no-report"]


def test_a_held_directory_is_refused_naming_its_holder_until_it_is_let_go(tmp_path):
    held = hold_run_dir(str(tmp_path))
    with pytest.raises(RunDirInUse, match=rf"--run-dir {tmp_path} is in use by another run \(pid "
                                          rf"{os.getpid()} on .+, since .+\): two runs in one "
                                          r"directory .* or give another --run-dir"):
        hold_run_dir(str(tmp_path))
    assert holder(str(tmp_path)).startswith(f"pid {os.getpid()} on ")
    release_run_dir(held)
    assert holder(str(tmp_path)) is None
    release_run_dir(hold_run_dir(str(tmp_path)))  # let go: the next run takes it
    assert (tmp_path / LOCK).read_text().startswith(f"pid {os.getpid()} on ")


def test_a_second_run_in_a_running_jobs_directory_writes_nothing_there(tmp_path, capsys):
    """It used to resume the first run's newest snapshot and write into the same
    metrics.jsonl at the same time (lines of both, interleaved and cut)."""
    run = tmp_path / "run"
    held = hold_run_dir(str(run))  # the first run, still training
    try:
        assert main([*TINY, "--run-dir", str(run)]) == 2
        said = capsys.readouterr().err
        assert f"ringtrain train: error: --run-dir {run} is in use by another run (pid " in said
        assert os.listdir(run) == [LOCK]  # no config.json, metrics, snapshots
    finally:
        release_run_dir(held)
    assert main([*TINY, "--run-dir", str(run)]) == 0  # once it has ended
    assert (run / "snapshots").is_dir() and (run / "summary.json").is_file()
    assert "training now" not in explain(load_run(str(run)))
    held = hold_run_dir(str(run))  # explain tells a run in progress by its lock
    try:
        said = " ".join(explain(load_run(str(run))).split())
        assert f"training now (pid {os.getpid()} on " in said, said
    finally:
        release_run_dir(held)
