"""benchmarks/tp_vs_torch.py at its quick size: torch's DTensor tensor parallelism, built from
the same GPT, trains exactly as ours (the same loss at every step), with and without sequence
parallelism; no timing is asserted. It also keeps the benchmark working on the torch versions
ringtrain supports (DTensor's API moves between them).

    .venv/bin/pytest -q tests/test_tp_vs_torch_bench.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "tp_vs_torch.py"


def test_quick_run_trains_both_the_same_and_reports_their_ratio():
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--steps", "2"],
                          capture_output=True, text=True, timeout=300,
                          cwd=BENCHMARK.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON
    assert [r["layout"] for r in result["rows"]] == ["tp 2", "tp 2 +SP"]
    for row in result["rows"]:
        assert row["loss_max_diff"] <= 1e-5, row
        assert row["loss_last"] < row["loss_first"], row  # it trained
        assert row["ratio"] == round(row["ours_ms"] / row["torch_ms"], 3)
