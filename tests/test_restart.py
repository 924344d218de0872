"""`ringtrain train` end to end: kill -9 of a worker under --max-restarts, SIGTERM to the launcher.

    .venv/bin/pytest -q tests/test_restart.py -s      # -s prints the measured recovery time

Each faulty run ends with the same `param_sha256` and logged losses as an uninterrupted one.
The faults come from the test-only RINGTRAIN_TEST_FAULT=ACTION:RANK:STEP (tests/support/faults.py,
through RINGTRAIN_STEP_HOOK): the worker itself sends the signal right after that step, so the
step is exact.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.faults import fault_env
from support.train_ranks import train_ranks

STEPS, EVERY = 24, 4
TINY = ["--nproc-per-node", "2", "--steps", str(STEPS), "--n-layer", "1", "--n-embd", "32",
        "--batch-size", "16", "--dropout", "0.1", "--eval-every", "12", "--log-every", "1",
        "--snapshot-every", str(EVERY), "--threads", "1", "--no-progress", "--no-report"]
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK")


def _train(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env.update(fault_env(fault))
    return subprocess.run([sys.executable, "-m", "ringtrain", "train", *TINY, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, timeout=180,
                          cwd=run_dir.parent, env=env)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, as `srun -n 2` runs it (no launcher: only its weights and losses
    are read; tests/support/train_ranks.py)."""
    run_dir = tmp_path_factory.mktemp("restart") / "reference"
    train_ranks([*TINY, "--run-dir", str(run_dir)], nproc=2)
    return _summary(run_dir), _losses(run_dir)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """One run directory, two faults: SIGTERM to the launcher after step 9 (the run stops, then
    the same command resumes it), and in that rerun a kill -9 of a worker at a random later
    step under --max-restarts 1 (the agent restarts every worker, which resume again)."""
    run_dir = tmp_path_factory.mktemp("restart") / "run"
    stopped = _train(run_dir, fault="term-launcher:1:9")
    snaps = run_dir / "snapshots"
    seen = {"listing": sorted(p.name for p in snaps.iterdir()),
            "summary": (run_dir / "summary.json").exists()}
    if (snaps / "snap-00000009").exists():
        seen["manifest"] = json.loads((snaps / "snap-00000009" / "manifest.json").read_text())
        seen["committed"] = (snaps / "snap-00000009" / "COMMITTED").exists()
        seen["rank_steps"] = [torch.load(snaps / "snap-00000009" / f"rank{r}.pt",
                                         weights_only=True)["step"] for r in range(2)]
    step, victim = random.randint(13, STEPS - 2), random.randint(0, 1)
    killed = _train(run_dir, "--max-restarts", "1", fault=f"kill:{victim}:{step}")
    return run_dir, stopped, seen, killed, (victim, step)


def test_sigterm_to_the_launcher_saves_one_step_on_every_rank(faulty):
    _, stopped, seen, _, _ = faulty
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "stopped at step 9 on SIGTERM" in stopped.stdout
    assert not seen["summary"]  # the run is not over
    assert seen["listing"] == ["snap-00000008", "snap-00000009"]  # the newest: step 9, committed
    assert seen["committed"] and seen["manifest"]["metadata"]["reason"] == "SIGTERM"
    assert seen["rank_steps"] == [9, 9]  # each rank's own file is of that step


def test_the_same_command_resumes_and_a_kill_9_restarts_every_worker(faulty, reference):
    run_dir, _, _, killed, (victim, step) = faulty
    what = f"kill -9 of rank {victim} after step {step}"
    assert killed.returncode == 0, what + "\n" + killed.stdout[-2000:] + killed.stderr[-3000:]
    summary = _summary(run_dir)
    # The kill comes before that step's snapshot: the restart resumes from the one before.
    assert summary["resumed_from_step"] == [9, (step - 1) // EVERY * EVERY], what
    assert summary["restarts"] == 1, what
    # Before the restart the launcher said which rank failed and how, once.
    assert killed.stderr.count(f"ringtrain run: rank {victim} failed (local_rank {victim}, ") == 1
    assert "killed by SIGKILL" in killed.stderr and "attempts left" not in killed.stderr
    assert killed.stderr.count("ringtrain run: restarting every worker (restart 1 of "
                               "--max-restarts 1)") == 1, killed.stderr[-3000:]
    assert summary["param_sha256"] == reference[0]["param_sha256"], what
    assert _losses(run_dir) == reference[1], what
    killed_at = float(re.search(r"test fault: kill after step \d+ at unix time ([\d.]+)",
                                killed.stderr)[1])
    recovery_s = summary["resumes"][-1]["first_step_unix"] - killed_at
    print(f"\nrecovery after {what}: {recovery_s:.2f} s from the kill to the first step after "
          "resuming")
    assert 0 < recovery_s < 60, recovery_s  # the goal is < 15 s; a loaded CI machine gets slack
    assert summary["snapshots_saved"] >= 1 and summary["snapshot_bytes_last"] > 0


def test_a_raising_worker_is_named_with_its_exception_and_one_traceback(tmp_path):
    run_dir = tmp_path / "raised"
    run_dir.mkdir()
    out = _train(run_dir, "--steps", "6", fault="raise:1:3")
    assert out.returncode == 1, out.stderr[-3000:]
    report = out.stderr[out.stderr.index("ringtrain run: rank 1 failed"):].splitlines()
    assert report[0].endswith("): RuntimeError: RINGTRAIN_TEST_FAULT: an exception raised on "
                              "rank 1 after step 3"), out.stderr[-3000:]
    # The worker printed its traceback; the report does not print it again.
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr[-3000:]


def test_no_resume_sets_the_earlier_run_aside_except_in_a_restarted_worker(tmp_path, monkeypatch):
    import logging

    from ringtrain.cli.run_dir_setup import resume_or_clear as _resume_or_clear
    from ringtrain.cli.train_args import parse_options

    args = parse_options(["--run-dir", str(tmp_path), "--no-resume"])
    (tmp_path / "snapshots" / "snap-00000004").mkdir(parents=True)
    rank0, rank1 = (SimpleNamespace(rank=r, world_size=2) for r in (0, 1))
    log = logging.getLogger("test")
    for restart in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):  # the same command
        with monkeypatch.context() as m:  # again under Slurm's requeue
            m.setenv(restart, "1")
            assert _resume_or_clear(args, rank0, log) is True  # a restart continues
            assert (tmp_path / "snapshots").exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _resume_or_clear(args, rank1, log) is False
    assert (tmp_path / "snapshots").exists()  # only rank 0 moves them
    for name in ("metrics.jsonl", "summary.json", "model.safetensors", "config.json"):
        (tmp_path / name).write_text(name)
    (tmp_path / "data").mkdir()  # a --data FILE.txt prepared here: the new run reads it too
    assert _resume_or_clear(args, rank0, log) is False
    # The earlier run is set aside whole, never deleted; what the new run uses stays.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "set-aside"]
    [aside] = (tmp_path / "set-aside").iterdir()
    assert aside.name.startswith("fresh-")
    assert sorted(p.name for p in aside.iterdir()) == [
        "config.json", "metrics.jsonl", "model.safetensors", "snapshots", "summary.json"]
    assert (aside / "snapshots" / "snap-00000004").is_dir()
    assert (aside / "metrics.jsonl").read_text() == "metrics.jsonl"
    assert _resume_or_clear(args, rank0, log) is False  # nothing left: nothing more made
    assert len(list((tmp_path / "set-aside").iterdir())) == 1
