"""What a warm background save costs a run, read from one run's step times (snapshot_stall.py).

A run's first saves are not what its later ones cost: the first allocates the page-locked host
buffers (and on a staged device the staging buffers), the second records the copy plan
(`ringtrain.checkpoint.copy_plan`) and sends the writer process its tensors; from the third on
a save replays the plan. A 405-step run of snapshot_stall.py with a snapshot every 100 steps has
four saves, two of them warm-up, and its throughput against `none` also carries the drift
between runs (none's mean step moved from 33.6 to 26.8 ms between two rounds on an H200,
session 39), so neither says what a save costs a long run. This does, within one run:

    extra = sum(steps k .. k+after) - (after + 1) * (the run's median step away from saves)

for each warm save (the snapshot of step k-1 lands in step k; the writer works through the
`after` steps that follow), and the throughput a run with a save every N steps would have at
that cost: N * median / (N * median + extra), an estimate, labelled so.
"""

from __future__ import annotations

import statistics

__all__ = ["warm_saves"]


def warm_saves(step_ms: list[float], every: int, warmup: int, after: int = 3,
               cold: int = 2) -> dict | None:
    """`step_ms`: one run's steps in ms, step k (1-based) at index k-1; the snapshot of step
    s*every lands in step s*every+1. Returns {"extra_ms": per warm save, "base_ms": the run's
    median step away from saves} or None where the run has no warm save with `after` steps
    timed after it."""
    n = len(step_ms)
    snap_steps = [s * every + 1 for s in range(1, n // every + 1) if s * every + 1 <= n]
    near = {k + d for k in snap_steps for d in range(after + 1)}
    away = [ms for k, ms in enumerate(step_ms, 1) if k > warmup and k not in near]
    warm = [k for k in snap_steps[cold:] if k + after <= n]
    if not warm or not away:
        return None
    base = statistics.median(away)
    extra = [sum(step_ms[k - 1:k + after]) - (after + 1) * base for k in warm]
    return {"extra_ms": [round(x, 2) for x in extra], "base_ms": round(base, 3)}


def projected_throughput(extra_ms: float, base_ms: float, every: int) -> float:
    """A run's steps per second with a save every `every` steps that costs `extra_ms`, against
    the same run without saves (an estimate from `warm_saves`' figures)."""
    return round(every * base_ms / (every * base_ms + extra_ms), 4)
