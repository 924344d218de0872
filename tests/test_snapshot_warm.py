"""benchmarks/snapshot_warm.py: a warm save's cost read from one run's step times (pure).

    .venv/bin/pytest -q tests/test_snapshot_warm.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from snapshot_warm import projected_throughput, warm_saves  # noqa: E402


def test_only_saves_from_the_third_on_count_against_the_runs_steps_away_from_saves():
    every, steps = 10, 45
    ms = [30.0] * steps
    for k, extra in ((11, 100.0), (21, 50.0), (31, 12.0), (41, 8.0)):  # saves 1-4
        ms[k - 1] += extra
        ms[k] += extra / 4  # the writer's work in the next step
    ms[0] = 500.0  # a warm-up step: not in the base
    got = warm_saves(ms, every, warmup=3, after=3)
    assert got == {"extra_ms": [15.0, 10.0], "base_ms": 30.0}
    # A save every 100 steps of 30 ms at 15 ms each: 3000 / 3015 of the throughput.
    assert projected_throughput(15.0, 30.0, 100) == round(3000 / 3015, 4)


def test_a_run_without_a_timed_warm_save_has_no_figure():
    assert warm_saves([30.0] * 25, 10, warmup=3) is None  # two saves: both cold
    assert warm_saves([30.0] * 32, 10, warmup=3) is None  # the third's next steps not timed
