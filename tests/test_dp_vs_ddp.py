"""benchmarks/dp_vs_ddp.py at a reduced size: its JSON, and the three ways agreeing after a step.

    .venv/bin/pytest -q tests/test_dp_vs_ddp.py

No timing is asserted (a busy machine moves every figure); only that each figure is there and
sane, and that one process, the DataParallel re-enactment and DDP take the same SGD step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "dp_vs_ddp.py"
FIGURES = ("single_ms", "dp_ms", "ddp_ms", "dp_vs_single", "ddp_vs_single", "dp_vs_single_paired",
           "ddp_vs_single_paired", "dp_replicate_ms", "dp_reduce_ms", "dp_thread_wait_share",
           "single_thread_wait_share", "dp_thread_cpu_ms", "dp_thread_wall_ms",
           "ddp_replicate_once_ms")


def test_small_run_reports_every_figure_and_equal_parameters():
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--small"], capture_output=True,
                          text=True, timeout=180, cwd=BENCHMARK.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON
    assert [r["model"] for r in result["results"]] == ["gpt", "mlp"]
    for key in ("loadavg_before", "loadavg_after"):
        assert len(result[key]) == 3
    for r in result["results"]:
        assert r["dp_impl"] == "cpu-reenactment" and r["replicas"] == 2
        assert r["params"] > 0 and r["global_batch"] % 2 == 0
        for key in FIGURES:
            assert r[key] >= 0, (r["model"], key)
        assert 0 <= r["dp_thread_wait_share"] < 1 and 0 <= r["single_thread_wait_share"] < 1
        # One SGD step from the same weights on the same global batch: all three agree.
        assert r["same_params"] is True, r
        assert r["max_abs_diff"]["dp"] < 1e-6 and r["max_abs_diff"]["ddp"] < 1e-6
