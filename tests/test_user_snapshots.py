"""`ringtrain.SnapshotManager` in a user's own script (examples/ddp_snapshots.py) under
`ringtrain run`: a rank killed mid-run, the job restarted, the script resumed from its newest
committed snapshot, and the final weights those of the run nothing interrupted; a finished run
extended by running it again with more steps.

    .venv/bin/pytest -q tests/test_user_snapshots.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp_snapshots.py"
CRASHING = REPO / "tests" / "scripts" / "user_snapshots_crash.py"


def _run(script: Path, run_dir: Path, *args: str, restarts: int = 0,
         env: dict[str, str] | None = None) -> tuple[str, str]:
    """(param_sha256, output) of `ringtrain run --nproc-per-node 2 script --run-dir run_dir`."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "2", "--max-restarts",
         str(restarts), str(script), "--run-dir", str(run_dir), *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, capture_output=True,
        text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return re.findall(r"param_sha256 ([0-9a-f]{64})", out)[-1], out


def _committed(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("snap-*") if (p / "COMMITTED").exists())


def test_a_killed_rank_restarts_from_the_newest_snapshot_to_the_same_weights(tmp_path):
    reference, out = _run(EXAMPLE, tmp_path / "straight", "--steps", "40")
    assert "resumed" not in out
    assert _committed(tmp_path / "straight") == ["snap-00000030", "snap-00000040"]  # keep=2
    crashed, out = _run(CRASHING, tmp_path / "crashed", "--steps", "40", restarts=1,
                        env={"CRASH_AT_STEP": "25"})
    # Steps 10 and 20 were saved before the kill in step 25 (20 perhaps still being written in
    # the background: then 10 is the newest committed one); never a step past the kill.
    # The launcher said which rank failed and why before it restarted them (not torch's
    # "Worker group FAILED. 1/1 attempts left"), once.
    assert out.count("ringtrain run: rank 1 failed (local_rank 1, ") == 1, out
    assert "exit code 17" in out and "attempts left" not in out
    assert out.count("ringtrain run: restarting every worker (restart 1 of --max-restarts 1)") == 1
    resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", out)
    assert resumed in (["20"], ["10"]), out
    assert crashed == reference


def test_a_finished_run_run_again_with_more_steps_goes_on_to_the_same_weights(tmp_path):
    reference, _ = _run(EXAMPLE, tmp_path / "straight", "--steps", "40")
    _run(EXAMPLE, tmp_path / "extended", "--steps", "20")
    extended, out = _run(EXAMPLE, tmp_path / "extended", "--steps", "40")
    assert re.findall(r"resumed from \S+ \(step (\d+)\)", out) == ["20"]
    assert extended == reference
