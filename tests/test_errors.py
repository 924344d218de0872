"""`ringtrain train` on user mistakes and Ctrl-C: one short message, exit 2 (or 128 + SIGINT).

    .venv/bin/pytest -q tests/test_errors.py

Most cases run `main` in this process, with the launcher replaced so nothing trains by
mistake; two start real workers: a snapshot written with other options (found only inside the
workers) and Ctrl-C to the whole process group. Names added with these fixes are imported
inside the tests that use them, so that against the code before them each test fails on its own.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from contextlib import suppress

import pytest
import torch
from support.faults import SUPPORT, fault_env
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ringtrain.cli.train import main
from ringtrain.cli.train_args import parse_options
from ringtrain.launch.process_group import destroy_distributed

TINY = ["--n-layer", "1", "--n-embd", "32", "--batch-size", "16", "--no-progress", "--threads", "1",
        "--no-report"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SHORT_USAGE = "usage: ringtrain train [options]; `ringtrain train --help` lists them"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RINGTRAIN_STARTED_AT", str(time.time()))  # main sets it before a launch
    monkeypatch.chdir(tmp_path)  # a default run dir would land here
    logger = logging.getLogger("ringtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate, torch.get_num_threads(),
             warnings.showwarning, signal.getsignal(signal.SIGINT))
    yield
    destroy_distributed()
    logger.handlers[:], logger.level, logger.propagate = saved[:3]  # leave no trace for other tests
    torch.set_num_threads(saved[3])
    warnings.showwarning = saved[4]
    signal.signal(signal.SIGINT, saved[5])


@pytest.fixture
def no_launch(monkeypatch):
    """Fail (rather than train) if `main` gets as far as starting the job."""
    def refuse(*args, **kwargs):
        raise AssertionError("the job started: the mistake was not caught before launch")
    monkeypatch.setattr("ringtrain.launch.launcher.launch", refuse)
    monkeypatch.setattr("ringtrain.cli.train.run_job", refuse)


# ---- found before any worker starts: two lines, exit 2 --------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--pp", "2", "--strategy", "ddp"], "--pp applies to --strategy pipeline, not ddp"),
    (["--pp", "2"], r"world_size=1 is not divisible by pp=2"),  # --pp chose pipeline
    (["--strategy", "pipeline", "--pp", "3", "--nproc-per-node", "2"],
     r"world_size=2 is not divisible by pp=3: .* or --pp in \[1, 2\]"),
    (["--strategy", "ps", "--servers", "2", "--nproc-per-node", "2"],
     r"--servers 2 leaves no worker among world_size=2 ranks; launch at least 3 processes"),
    (["--batch-size", "5000", "--nproc-per-node", "2"],
     r"--batch-size 5000 is more than .*: 9500 samples over 2 data ranks is 4750 each; use "
     r"--batch-size 4750 or less"),
    (["--batch-size", "10000"], r"9500 samples over 1 data rank is 9500 each"),
    (["--strategy", "ps", "--servers", "1", "--nproc-per-node", "3", "--batch-size", "4800"],
     r"9500 samples over 2 data ranks is 4750 each"),  # servers read no data
    (["--strategy", "pipeline", "--pp", "2", "--microbatches", "3", "--nproc-per-node", "2"],
     r"--microbatches 3 must divide the 16 samples of a step .*"
     r"--microbatches in \[1, 2, 4, 8, 16\]"),
    (["--strategy", "pipeline", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
      "--microbatches", "1", "--nproc-per-node", "2"],
     r"--microbatches 1 is fewer than --pp 2 stages: interleaved .* --schedule 1f1b"),
    (["--strategy", "pipeline", "--pp", "2", "--schedule", "zb-v", "--virtual-stages", "3",
      "--nproc-per-node", "2"],
     r"--virtual-stages 3: zb-v holds 2 chunks per rank in a V \(use --virtual-stages 1"),
])
def test_a_mistake_is_two_lines_and_exit_2(argv, message, capsys, no_launch, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # no warning about cores in the count
    assert main([*TINY, *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == SHORT_USAGE and len(lines) == 2, lines
    assert lines[1].startswith("ringtrain train: error: ") and re.search(message, lines[1]), lines
    assert not os.path.exists("runs")  # nothing created for a rejected command


def test_help_still_lists_every_option(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ringtrain train [-h]") and "--nproc-per-node" in out
    assert "--staleness" in out


def test_the_layout_is_checked_where_the_world_size_is_known(monkeypatch):
    from ringtrain.cli.relaunch import known_world_size
    from ringtrain.cli.train_args import check_args

    args = parse_options(["--strategy", "pipeline", "--pp", "3", "--nnodes", "1:2"])
    assert known_world_size(args) is None  # elastic: the workers check, once they know
    check_args(parse_options(["--strategy", "pipeline", "--pp", "3"]))
    with pytest.raises(ValueError, match="world_size=4 is not divisible by pp=3"):
        check_args(parse_options(["--strategy", "pipeline", "--pp", "3"]), world_size=4)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert known_world_size(parse_options(["--nproc-per-node", "2"])) == 6


def test_training_set_sizes_are_counted_without_building_it(tmp_path):
    """`check_args` counts the training samples with a formula: it must match the datasets."""
    from ringtrain.cli.train_args import check_args
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.data.chars import load_text

    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 40)
    windows = len(load_text(str(text), 8).train_set)
    for argv, n in ((["--digits", "1"], len(AdditionDataset("train", 1))),
                    (["--digits", "2"], len(AdditionDataset("train", 2))),
                    (["--data", str(text), "--block-size", "8"], windows)):
        check_args(parse_options([*argv, "--batch-size", str(n)]), world_size=1)
        with pytest.raises(ValueError, match=f"{n} samples over 1 data rank"):
            check_args(parse_options([*argv, "--batch-size", str(n + 1)]), world_size=1)


# ---- warnings: one line each, where the command was typed ------------------------------------

def test_more_workers_than_cores_warns_once_at_launch(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    launched = []
    monkeypatch.setattr("ringtrain.launch.launcher.launch", lambda *a, **k: launched.append(k) or 0)
    assert main(["--nproc-per-node", "3", "--run-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert launched and err.count("--nproc-per-node 3 is more than this machine's 2 CPU cores") == 1
    assert len(err.splitlines()) == 1, err


def test_a_one_character_text_warns_once(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("ringtrain.cli.train.run_job", lambda *a, **k: 0)
    data = tmp_path / "a.txt"
    data.write_text("a" * 2000)
    assert main(["--data", str(data), "--block-size", "8", "--run-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert err.count("the text has a vocabulary of one character ('a')") == 1, err


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_when_every_snapshot_is_corrupt_training_starts_afresh(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TINY, "--steps", "2", "--snapshot-every", "1", "--run-dir", str(run)]
    assert main(argv) == 0
    parts = list(run.glob("snapshots/snap-*/*.pt"))
    assert len({p.parent for p in parts}) == 2
    for p in parts:
        p.write_bytes(b"not a snapshot")
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "none of the 2 snapshots in" in err and "training starts afresh from step 0" in err, err


# ---- found inside the workers, and the launcher's part ---------------------------------------

def _failure(tmp_path, rank: int, exitcode: int, raised: str | None = None) -> ProcessFailure:
    path = tmp_path / f"error_{rank}.json"
    if raised is not None:
        path.write_text(json.dumps({"message": {"message": raised, "extraInfo": {
            "py_callstack": raised, "timestamp": "1700000000"}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_launcher_adds_nothing_to_a_mistake_the_workers_explained(tmp_path):
    from ringtrain.launch.failure_report import explained_by_workers

    assert explained_by_workers({0: _failure(tmp_path, 0, 2), 1: _failure(tmp_path, 1, 2)})
    stopped_after = _failure(tmp_path, 0, -signal.SIGTERM)  # by the launcher, once rank 1 exited
    assert explained_by_workers({1: _failure(tmp_path, 1, 2), 0: stopped_after})
    assert not explained_by_workers({0: _failure(tmp_path, 0, 2, "ValueError: raised, not said")})
    assert not explained_by_workers({0: _failure(tmp_path, 0, 1), 1: _failure(tmp_path, 1, 2)})
    assert not explained_by_workers({0: _failure(tmp_path, 0, -signal.SIGTERM)})


def test_a_snapshot_with_other_options_is_one_message_from_the_workers(tmp_path):
    run = tmp_path / "run"
    argv = [*TINY, "--steps", "2", "--snapshot-every", "1", "--run-dir", str(run)]
    assert main(argv) == 0  # one process writes the snapshots; two workers then find them
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *argv,
         "--lr", "0.01"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    message = "was saved by a run with other options: --lr 0.003 in the snapshot, 0.01 now"
    assert out.count(message) == 1 and "Traceback" not in out, out
    assert len(out.splitlines()) <= 3, out  # the model line, the error, nothing from the launcher


# ---- Ctrl-C ----------------------------------------------------------------------------------

def test_ctrl_c_in_one_process_saves_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    for name, value in fault_env("int:0:2").items():  # SIGINT after step 2, as Ctrl-C does
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(SUPPORT))  # this process runs the worker: it imports faults
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    run = tmp_path / "run"
    try:
        rc = main([*TINY, "--steps", "50", "--snapshot-every", "100", "--run-dir", str(run)])
    except KeyboardInterrupt:  # not let through: pytest would end the whole session
        pytest.fail("KeyboardInterrupt escaped main")
    out, err = capsys.readouterr()
    assert rc == 130, out + err
    assert "stopped at step 2 on SIGINT; snapshot of step 2" in out
    assert "run the same command again to resume" in out and "Traceback" not in err
    manifest = json.loads((run / "snapshots" / "snap-00000002" / "manifest.json").read_text())
    assert manifest["metadata"]["reason"] == "SIGINT"


def _wait_for_lines(path, n: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} metric lines in {path} within {timeout_s} s (exit {proc.poll()})")


def test_ctrl_c_stops_every_rank_at_one_snapshot(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--steps", "100000", "--log-every", "1", "--eval-every", "100000",
         "--snapshot-every", "100000", "--run-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=ENV,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        _wait_for_lines(run / "metrics.jsonl", 3, proc, timeout_s=120)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher and every worker
        out, _ = proc.communicate(timeout=60)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == 130, out
    stop = re.search(r"stopped at step (\d+) on SIGINT; snapshot of step (\d+) in .*: run the same "
                     r"command again to resume", out)
    assert stop and stop[1] == stop[2], out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len(out.splitlines()) <= 7, out  # start lines (TensorBoard's too) and the stop, once
    snap = run / "snapshots" / f"snap-{int(stop[1]):08d}"
    manifest = json.loads((snap / "manifest.json").read_text())
    assert (snap / "COMMITTED").exists() and manifest["metadata"]["reason"] == "SIGINT"
    assert {"rank0.pt", "rank1.pt"} <= set(manifest["files"]), manifest["files"]  # both ranks
