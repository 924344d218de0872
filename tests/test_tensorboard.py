"""TensorBoard event files (`ringtrain/training/tensorboard.py`): a 2-process `ringtrain train`
writes them on rank 0 only, with the same figures as metrics.jsonl; without the package the run
says so once and goes on. The same run checks `--trace-steps` from the command line.

    .venv/bin/pytest -q tests/test_tensorboard.py
"""

import builtins
import json
import logging
import os
import subprocess
import sys

import pytest

from ringtrain.training.progress import MetricsLog
from ringtrain.training.tensorboard import TensorBoardLog, tag

TINY = ["--steps", "6", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--batch-size", "16",
        "--log-every", "2", "--eval-every", "3", "--eval-batch-size", "64", "--digits", "1",
        "--no-progress", "--no-report", "--threads", "1", "--snapshot-every", "0"]


def test_tags_group_the_metrics():
    assert [tag(k) for k in ("loss", "eval_loss", "lr", "tokens_per_s", "compute_s", "comm_s",
                             "eval_accuracy", "time_s", "step")] == [
        "loss/train", "loss/eval", "lr", "throughput/tokens_per_s", "time/compute_s",
        "time/comm_s", "eval/accuracy", None, None]


def test_without_tensorboard_it_says_so_once_and_keeps_metrics_jsonl(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError("No module named 'tensorboard' (simulated)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    # A handler on the logger itself sees each emission once. caplog would not: pytest >= 9
    # also attaches its handler to non-propagating loggers, and `ringtrain` is one once any
    # earlier test in this process ran setup_logging, so a record could arrive twice.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("ringtrain")
    # setLevel, not a patched `level`: setLevel clears the loggers' isEnabledFor cache, which
    # an earlier test in this process (a rank-1 setup_logging at WARNING) may have filled.
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        log = TensorBoardLog(MetricsLog(str(tmp_path / "metrics.jsonl")), str(tmp_path))
        log.write({"step": 1, "loss": 2.0})
        log.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [r.getMessage().split(" (")[0] for r in records] == ["TensorBoard: off"]
    assert log.records == [{"step": 1, "loss": 2.0}] and not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.0}


def test_two_processes_write_one_event_file_with_the_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed "
                        "(pip install -e '.[dev]' or '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--run-dir", str(run_dir), "--trace-steps", "2:4"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("TensorBoard: event files in") == 1  # said once, by rank 0
    files = os.listdir(run_dir / "tensorboard")
    assert len(files) == 1 and files[0].startswith("events.out.tfevents."), files  # rank 0 only
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key, name in [("loss", "loss/train"), ("lr", "lr"),
                      ("tokens_per_s", "throughput/tokens_per_s"),
                      ("compute_s", "time/compute_s"), ("comm_s", "time/comm_s"),
                      ("eval_loss", "loss/eval"), ("eval_accuracy", "eval/accuracy")]:
        want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in want] and want, name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), name  # float32
    assert [e.step for e in acc.Scalars("loss/eval")] == [3, 6]
    # --trace-steps through the command line: one trace of both ranks, named in the summary.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trace"] == str(run_dir / "trace.json")
    trace = json.loads((run_dir / "trace.json").read_text())
    steps = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["name"].startswith("step ")}
    assert steps == {(r, f"step {s}") for r in (0, 1) for s in (2, 3)}


def test_a_resumed_run_hides_the_steps_it_trains_again(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLog(MetricsLog(None), str(tmp_path))
    for step in (1, 2, 3, 4):  # crashed after step 4; the snapshot was taken at step 2
        first.write({"step": step, "loss": float(step)})
    first.close()
    again = TensorBoardLog(MetricsLog(None), str(tmp_path), resume_step=2)
    for step in (3, 4, 5):
        again.write({"step": step, "loss": 10.0 + step})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [
        (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
