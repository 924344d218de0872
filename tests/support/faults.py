"""Test-only fault injection into `ringtrain train`, through its RINGTRAIN_STEP_HOOK hook point.

    RINGTRAIN_STEP_HOOK=faults:hook RINGTRAIN_TEST_FAULT=kill:1:5 PYTHONPATH=tests/support \
        ringtrain train --nproc-per-node 2             # rank 1 dies after step 5
    RINGTRAIN_TEST_FAULT=plan:/tmp/plan.json ...       # a chaos schedule (chaos_plan.py)

`fault_env(spec)` gives those variables for a subprocess; tests and benchmarks/chaos.py start
`ringtrain train` with it. This folder (tests/support) is on the workers' PYTHONPATH, not in the
package: ringtrain itself holds only the generic hook point (`ringtrain/cli/step_hook.py`).
Tests: `.venv/bin/pytest -q tests/test_testing.py tests/test_restart.py`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support
REPO = SUPPORT.parent.parent
FAULT_ENV = "RINGTRAIN_TEST_FAULT"
FAULT_ACTIONS = ("kill", "kill-next", "stop", "term", "term-launcher", "int", "raise")


def fault_env(spec: str) -> dict[str, str]:
    """The variables under which a `ringtrain train` subprocess plays the fault `spec`.

    RINGTRAIN_TEST_FAULT=spec, RINGTRAIN_STEP_HOOK=faults:hook, and PYTHONPATH with this folder
    and the repository first (then the caller's PYTHONPATH), so every worker imports this module.
    """
    path = [str(SUPPORT), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {FAULT_ENV: spec, "RINGTRAIN_STEP_HOOK": "faults:hook",
            "PYTHONPATH": os.pathsep.join(path)}


def snapshot_written(timeout_s: float = 60.0) -> None:
    """Wait (bounded) for this process's snapshot writer, if one is at work in the background.

    A `kill` here is a kill between snapshots, so the tests can name the step a restart resumes
    from; a kill *during* the background write is tests/test_async_snapshots.py's case.
    """
    for thread in threading.enumerate():
        if thread.name.startswith("snapshot-writer-"):  # ringtrain.checkpoint.background
            thread.join(timeout_s)


def hook(on_step: Callable[[int], None] | None, rank: int) -> Callable[[int], None] | None:
    """Wrap a trainer's `on_step` with the fault RINGTRAIN_TEST_FAULT=ACTION:RANK:STEP asks for.

    After step STEP, rank RANK does ACTION: `kill` (SIGKILL itself, as `kill -9`), `kill-next`
    (SIGKILL itself in the next step's first forward: mid-step, after the step's agreement
    questions were answered, so the others find it in that step's collectives), `stop`
    (SIGSTOP itself: a hang, alive but silent, until someone kills it), `term`
    (SIGTERM itself), `int` (SIGINT itself, as Ctrl-C), `raise` (an exception out of the loop)
    or `term-launcher` (SIGTERM its parent,
    the launcher, and wait for the signal it forwards, so the job stops at that step). Only in
    the first attempt of a job (TORCHELASTIC_RESTART_COUNT 0), so a restarted job runs through,
    and never in a live replacement (which redoes a local SGD round, the fault's step included).
    It prints the wall-clock time first, so a test can time the recovery. Returns `on_step`
    itself when the variable is unset or names another rank. Several faults are separated by
    commas (`kill:1:3,stop:2:7`). `plan:FILE` is a chaos schedule, played in every attempt
    (`chaos_plan.plan_hook`).

    Args:
        on_step: the callback to keep calling first (a watchdog's `set_step`), or None.
        rank: this process's rank.
    """
    spec = os.environ.get(FAULT_ENV)
    if spec and spec.startswith("plan:"):  # a chaos schedule (benchmarks/chaos.py), every attempt
        from chaos_plan import plan_hook

        return plan_hook(on_step, rank, spec[len("plan:"):])
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return on_step
    if os.environ.get("RINGTRAIN_LIVE_REPLACEMENT"):  # --live: it may redo the fault's step
        return on_step
    for one in spec.split(",")[:-1]:  # several faults: "kill:1:3,stop:2:7", each its own hook
        on_step = _one_fault(on_step, rank, one)
    return _one_fault(on_step, rank, spec.split(",")[-1])


def _one_fault(on_step: Callable[[int], None] | None, rank: int,
               spec: str) -> Callable[[int], None] | None:
    try:
        action, fault_rank, fault_step = spec.split(":")
        at_rank, at_step = int(fault_rank), int(fault_step)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected ACTION:RANK:STEP, "
                         "e.g. kill:1:5") from None
    if action not in FAULT_ACTIONS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: ACTION is one of {', '.join(FAULT_ACTIONS)}")
    if at_rank != rank:
        return on_step

    def fault(step: int) -> None:
        if on_step is not None:
            on_step(step)
        if step != at_step:
            return
        if action in ("kill", "kill-next"):
            snapshot_written()
        print(f"[rank {rank}] test fault: {action} after step {step} at unix time "
              f"{time.time():.3f}", file=sys.stderr, flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill-next":
            import torch  # the workers have it imported: ringtrain train's

            torch.nn.modules.module.register_module_forward_pre_hook(
                lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "int":
            os.kill(os.getpid(), signal.SIGINT)
        elif action == "raise":
            raise RuntimeError(f"{FAULT_ENV}: an exception raised on rank {rank} after step {step}")
        else:  # term-launcher
            os.kill(os.getppid(), signal.SIGTERM)
            # Wait (bounded) until the launcher has forwarded it here, so this is the stop step.
            stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            deadline = time.monotonic() + 10
            while getattr(stop, "received", 0) is None and time.monotonic() < deadline:
                time.sleep(0.01)
    return fault
