"""A step hook for live tests: `faults.hook`'s faults, and a member that waits after a step
until a replacement process has started.

    RINGTRAIN_STEP_HOOK=await_replacement:hook RINGTRAIN_TEST_FAULT=kill:1:3 \
    RINGTRAIN_TEST_AWAIT=0:4:/tmp/marks ringtrain train --live ...   # rank 0 waits after step 4

Why: a survivor that goes on alone (no --live-wait) trains a test's few steps in less time than
a replacement takes to start (import torch, build the model: seconds on a loaded machine), so
the job would end before the replacement is let in and the re-shard onto it (1 -> 2 members)
would never run. A replacement marks FOLDER as its hook is installed, just before it registers
with the job (`ringtrain.cli.worker`); the member waiting for that mark (at most `WAIT_S`) then
lets it in at one of the next step boundaries. `await_env(rank, step, folder)` gives the
variables, beside `faults.fault_env`'s.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

AWAIT_ENV = "RINGTRAIN_TEST_AWAIT"
WAIT_S = 180.0  # a replacement starts in seconds; this bounds a test that would hang


def await_env(rank: int, step: int, folder: Path) -> dict[str, str]:
    """The variables (over `faults.fault_env`'s) under which launcher rank `rank` waits after
    `step` for a replacement to start."""
    return {"RINGTRAIN_STEP_HOOK": "await_replacement:hook", AWAIT_ENV: f"{rank}:{step}:{folder}"}


def hook(on_step: Callable[[int], None] | None, rank: int) -> Callable[[int], None] | None:
    """`faults.hook(on_step, rank)`, then: a replacement marks the folder; the rank named in
    RINGTRAIN_TEST_AWAIT=RANK:STEP:FOLDER waits for the mark after step STEP."""
    import faults  # a worker's: tests/support is on its PYTHONPATH (`faults.fault_env`)

    on_step = faults.hook(on_step, rank)
    spec = os.environ.get(AWAIT_ENV)
    if not spec:
        return on_step
    at_rank, at_step, folder = spec.split(":", 2)
    mark = Path(folder) / "replacement-started"
    if os.environ.get("RINGTRAIN_LIVE_REPLACEMENT"):
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
        return on_step
    if int(at_rank) != rank:
        return on_step

    def wait(step: int) -> None:
        if on_step is not None:
            on_step(step)
        if step != int(at_step):
            return
        deadline = time.monotonic() + WAIT_S
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polls a condition: the mark, not a guess at how long it takes
        print(f"[rank {rank}] test: after step {step}, a replacement "
              f"{'has started' if mark.exists() else f'did not start within {WAIT_S:g} s'}",
              file=sys.stderr, flush=True)
    return wait
