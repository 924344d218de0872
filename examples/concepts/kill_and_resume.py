"""Fault tolerance: a worker is killed mid-run; the job restarts, resumes, and ends bit-identical.

    .venv/bin/python examples/concepts/kill_and_resume.py        # 2 runs of 2 ranks, ~30 s

Runs `ringtrain train --nproc-per-node 2 --steps 60 --snapshot-every 20` twice: once undisturbed,
once with `--max-restarts 1` and RINGTRAIN_TEST_FAULT=kill:1:30, which makes rank 1 SIGKILL
itself after step 30 (the tests' fault hook, tests/support/faults.py, which `ringtrain train`
runs after every step through RINGTRAIN_STEP_HOOK=faults:hook). The watchdog and the elastic
launcher stop rank 0, start both workers again, and they resume from the newest committed snapshot
(step 20: `ringtrain/checkpoint/`), with the sampler's position and every rank's RNG restored.
Steps 21-30 are trained twice; the final weights' param_sha256 equals the undisturbed run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[2] / "tests" / "support"  # faults.py
ARGS = ["--nproc-per-node", "2", "--steps", "60", "--snapshot-every", "20", "--threads", "1",
        "--no-progress"]


def train(run_dir: Path, env: dict[str, str], *extra: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "train", *ARGS, *extra, "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    if proc.returncode != 0:
        raise SystemExit(f"ringtrain train exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text()), time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clean, clean_s = train(Path(tmp) / "clean", {})
        fault = {"RINGTRAIN_TEST_FAULT": "kill:1:30", "RINGTRAIN_STEP_HOOK": "faults:hook",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT),
                                                             os.environ.get("PYTHONPATH")]))}
        killed, killed_s = train(Path(tmp) / "killed", fault, "--max-restarts", "1")
    for name, s, wall in (("undisturbed", clean, clean_s), ("rank 1 killed", killed, killed_s)):
        resumed = ", ".join(map(str, s["resumed_from_step"])) or "-"
        print(f"{name:<14} restarts {s['restarts']}  resumed from step {resumed:<3} {wall:5.1f} s"
              f"  param_sha256 {s['param_sha256'][:16]}")
    print("identical final weights:", clean["param_sha256"] == killed["param_sha256"])


if __name__ == "__main__":
    main()
