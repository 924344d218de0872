"""Run a benchmark script as a user would and read its last line, the JSON every one prints.

    result = bench_json("tp_vs_torch.py", "--quick", "--steps", "2")
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def bench_json(script: str, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    """`python benchmarks/SCRIPT ARGS` from the repository root; its last line, parsed. A
    non-zero exit fails the test with everything the script printed."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
