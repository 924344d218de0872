"""Slow links: DiLoCo restarted after kill -9, and the slow-link benchmark in a reduced size.

    .venv/bin/pytest -q tests/test_slow_link.py

- `ringtrain train --strategy diloco --max-restarts 1` with a worker killed (SIGKILL) mid-run
  ends with the same `param_sha256` as the run without the fault: the snapshot holds the
  outer optimizer, the weights of the last outer step and the inner step count;
- `benchmarks/slow_link.py --quick` on two network-namespace hosts with a 50 Mbit/s link:
  DiLoCo sends several times fewer bytes than DDP (the kernel's counters), both train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from netns import unavailable
from support.faults import fault_env
from support.train_ranks import train_ranks

REPO = Path(__file__).resolve().parent.parent
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK", "GLOO_SOCKET_IFNAME")
DILOCO = ["--nproc-per-node", "2", "--steps", "16", "--n-layer", "1", "--n-embd", "32",
          "--batch-size", "16", "--dropout", "0.1", "--eval-every", "8", "--log-every", "2",
          "--snapshot-every", "4", "--threads", "1", "--no-progress", "--strategy", "diloco",
          "--sync-every", "3", "--outer-compress", "bf16", "--no-report"]


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env.update(fault_env(fault))
    return env


def _train(run_dir: Path, *extra: str, fault: str | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "train", *DILOCO, "--run-dir",
                           str(run_dir), *extra], capture_output=True, text=True, timeout=240,
                          cwd=run_dir.parent, env=_env(fault))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_diloco_restarts_after_kill_and_ends_where_an_unbroken_run_ends(tmp_path):
    # The unbroken run as `srun -n 2` runs it: no launcher, its weights are all that is read.
    train_ranks([*DILOCO, "--run-dir", str(tmp_path / "reference")], nproc=2)
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    # Killed after step 6 (between the snapshots of steps 4 and 8, mid outer step 3..6..9):
    # the restarted workers resume from step 4 and redo steps 5..6.
    faulty = _train(tmp_path / "faulty", "--max-restarts", "1", fault="kill:1:6")
    assert faulty["restarts"] == 1 and faulty["resumed_from_step"] == [4]
    assert faulty["param_sha256"] == reference["param_sha256"]
    assert faulty["meetings"] == reference["meetings"] == 6  # 5 at steps 3..15, 1 at the end


@pytest.mark.multinode
def test_slow_link_benchmark_reduced():
    reason = unavailable()
    if reason:
        pytest.skip(f"the slow-link benchmark needs network namespaces: {reason}")
    proc = subprocess.run([sys.executable, "benchmarks/slow_link.py", "--quick", "--steps", "30",
                           "--ways", "ddp,diloco:10", "--no-reference", "--delay", ""],
                          capture_output=True, text=True, timeout=660, cwd=REPO, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ddp, diloco = out["results"]["slow/ddp"], out["results"]["slow/diloco:10"]
    assert diloco["bytes_vs_ddp"] > 4  # 3 meetings instead of 30 all-reduces, plus the store
    assert 0 < diloco["final_eval_loss"] < 5 and 0 < ddp["final_eval_loss"] < 5
