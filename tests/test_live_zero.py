"""`ringtrain train --strategy zero --live` end to end (CLI, gloo, CPU, 2 workers, a tiny GPT).

    .venv/bin/pytest -q -m slow tests/test_live_zero.py     # slow: ~85 s on 2 loaded cores

Three jobs of ZeRO stage 2, started together (they mostly wait: for a dead peer, for a
replacement's start-up):
- "clean": no fault, the reference;
- "replaced": after step 3, launcher rank 1 is killed (SIGKILL); `--live-wait 60` makes the
  survivor wait for the replacement, so every step runs on 2 members. The survivor keeps its
  pid; the replacement heals the model from it and gets the lost rank's optimizer shard from
  the copy the survivor (its buddy) received at the commit of step 3
  (`ringtrain.strategies.zero_live`). The run ends with the clean run's `param_sha256` and
  sample history: the redone step 4 is the fault-free one, bit for bit;
- "alone": the same kill without `--live-wait`: the survivor re-shards the whole optimizer
  state onto itself (its own part and the copy, 2 ranks -> 1) and trains on alone, each step's
  global batch the clean run's, its loss within 1e-4 of the clean run's (one member sums the
  gradients in another order); a replacement that starts before the run ends is let in at a
  later step and re-sharded into (1 -> 2), one that starts later leaves.
The re-shard itself, without processes: tests/test_zero_live.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.faults import fault_env
from support.live_history import assert_fault_free_history, live_members, wait_all

from ringtrain.data.sample_log import SampleLog

STEPS, BATCH, WORLD, AT = 8, 8, 2, 3
ARGV = ["--strategy", "zero", "--zero-stage", "2", "--nproc-per-node", str(WORLD), "--steps",
        str(STEPS), "--n-layer", "1", "--n-embd", "32", "--batch-size", str(BATCH), "--dropout",
        "0", "--log-every", "1", "--eval-every", str(STEPS), "--snapshot-every", str(STEPS),
        "--threads", "1", "--no-progress", "--no-report", "--device", "cpu", "--live",
        "--record-samples", "--watchdog-timeout", "6"]
FULL = os.environ.get("RINGTRAIN_FULL") == "1"
JOBS = {"clean": (None, ["--live-wait", "60"]), "replaced": (f"kill:1:{AT}", ["--live-wait", "60"]),
        **({"alone": (f"kill:1:{AT}", [])} if FULL else {})}  # the re-shards 2 -> 1 -> 2
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK")


def _start(run_dir: Path, fault: str | None, extra: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env.update(fault_env(fault))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "ringtrain", "train", *ARGV, *extra,
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=run_dir.parent, env=env)


pytestmark = pytest.mark.slow  # CLI jobs of 2 workers and a replacement; "alone" under FULL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_zero")
    procs = {name: _start(root / name, fault, extra) for name, (fault, extra) in JOBS.items()}
    return wait_all(procs, {name: root / name for name in procs})


def _history(run_dir: Path) -> SampleLog:
    shared = torch.load(run_dir / "snapshots" / f"snap-{STEPS:08d}" / "shared.pt",
                        weights_only=True)
    return SampleLog.from_state(shared["trainer"]["samples"])


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_the_survivor_keeps_its_pid_and_the_replacement_gets_the_lost_shard(runs):
    run_dir, stderr = runs["replaced"]
    by_slot = {(m["launcher_rank"], m["joined_at_step"]): m for m in live_members(run_dir)}
    assert len(by_slot) == 3, by_slot  # 2 started, 1 replacement
    survivor, killed, replacement = by_slot[0, 0], by_slot[1, 0], by_slot[1, AT]
    assert survivor["status"] == "finished" and survivor["step"] == STEPS
    assert survivor["recoveries"] == 1 and killed["status"] == "training"
    assert replacement["status"] == "finished" and replacement["members"] == WORLD
    assert f"(pid {killed['pid']}) killed by SIGKILL" in stderr, stderr[-3000:]
    summary = _summary(run_dir)
    assert summary["steps"] == STEPS and summary["zero_stage"] == 2
    assert summary["zero_buddy_bytes_per_step"] > 0  # the copy's cost, in the summary


def test_with_the_world_size_restored_the_run_is_the_fault_free_one(runs):
    (replaced, _), (clean, _) = runs["replaced"], runs["clean"]
    assert _summary(replaced)["param_sha256"] == _summary(clean)["param_sha256"]
    got, want = _losses(replaced), _losses(clean)
    # Step 3's line was reduced as the member died after it: answered by the survivor alone
    # (`agreement.generations`); every other step's loss is the clean run's, exactly.
    assert {s: v for s, v in got.items() if s != AT} == {s: v for s, v in want.items() if s != AT}
    assert_fault_free_history(_history(replaced), _history(clean), steps=STEPS,
                              global_batch=BATCH * WORLD)


@pytest.mark.skipif(not FULL, reason="RINGTRAIN_FULL=1: a third job (suite time)")
def test_a_survivor_alone_trains_the_same_batches_with_the_whole_state(runs):
    (alone, stderr), (clean, _) = runs["alone"], runs["clean"]
    survivor = next(m for m in live_members(alone) if m["launcher_rank"] == 0)
    assert survivor["status"] == "finished" and survivor["recoveries"] >= 1
    assert "1 of 2 members" in stderr, stderr[-3000:]
    got, want = _losses(alone), _losses(clean)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert all(abs(got[s] - want[s]) < 1e-4 for s in want if s != AT), (got, want)
    assert_fault_free_history(_history(alone), _history(clean), steps=STEPS,
                              global_batch=BATCH * WORLD)
