"""benchmarks/gpu_gpt.py at a tiny size: its JSON is there and sane (no timing is asserted).

    .venv/bin/pytest -q tests/test_gpu_gpt_bench.py

CPU (the conftest sets RINGTRAIN_DEVICE=cpu, which the subprocess inherits), one process, gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_gpt.py"


def test_tiny_run_reports_both_sides_and_their_ratio():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--rounds", "2", "--steps", "2", "--log-every", "1",
         "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
         "--batch-size", "4"],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARK.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["threads"] == 1
    assert result["shape"] == {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8,
                               "batch_size": 4}
    assert len(result["trainer_ms_rounds"]) == len(result["plain_ms_rounds"]) == 2
    assert result["trainer_ms"] > 0 and result["plain_ms"] > 0
    assert result["ratio"] == result["trainer_ms"] / result["plain_ms"]
    assert result["mfu_trainer"] is None and result["compiled"] is None  # CPU, no --compile
    assert "ratio" in proc.stdout.splitlines()[0]  # the human summary comes first
