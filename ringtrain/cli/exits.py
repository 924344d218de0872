"""How `ringtrain train` ends: its exit codes, and a mistake said once, by rank 0.

    0    finished
    2    a mistake in the options (`ringtrain.errors.USAGE_EXIT_CODE`)
    143  stopped on SIGTERM or SIGUSR1, a snapshot saved: "requeue me" (`REQUEUE_EXIT_CODE`)
    130  stopped by Ctrl-C (SIGINT)
    74   the run directory filled up: stopped at the last committed snapshot
         (`ringtrain.errors.DISK_FULL_EXIT_CODE`)
    76   a worker of a `--live` job left out by its peers (too slow, or silent): its agent
         starts a replacement (`ringtrain.launch.live_agent.LEFT_OUT_EXIT_CODE`)

A mistake every rank finds (a snapshot written with other options) is printed by rank 0 alone,
and no rank exits before it has (`explain_once`): the launcher then adds nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from datetime import timedelta

from ringtrain.cli.relaunch import in_launched_worker
from ringtrain.errors import REQUEUE_EXIT_CODE, USAGE_EXIT_CODE, ConfigError

# What a launched worker exits with after it stopped on a signal (SIGTERM, SIGUSR1 or SIGINT)
# and saved a snapshot: 143, whichever signal it was (the launcher's failure report knows it).
STOPPED_EXIT_CODE = REQUEUE_EXIT_CODE
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # Ctrl-C outside the training loop: nothing saved
MISTAKE_WAIT_S = 10.0  # how long a rank waits for the others to find the same ConfigError


def explain_once(error: ConfigError | str, rt, exit_code: int = USAGE_EXIT_CODE) -> int:
    """Rank 0 prints `error`; every rank returns `exit_code` once all have found it (bounded wait).

    Every rank finds the same mistake (same options, same files) at about the same time. No
    rank exits before rank 0 has printed: the launcher stops the others as soon as one exits,
    which could cut rank 0 off. A rank left waiting (rank 0 never found it) says it itself.
    Also used for a disk that filled up: every rank stops at the same failed save.
    """
    if rt.rank == 0:
        print(f"ringtrain train: error: {error}", file=sys.stderr, flush=True)
    if rt.world_size == 1:
        return exit_code
    keys = [f"ringtrain/config_error/{r}" for r in range(rt.world_size)]
    try:
        rt.store.set(keys[rt.rank], "1")
        rt.store.wait(keys, timedelta(seconds=MISTAKE_WAIT_S))
    except RuntimeError:  # a rank went on, or the store's host (rank 0) has exited
        told = True
        with contextlib.suppress(RuntimeError):
            told = rt.store.check(keys[:1])
        if not told:
            print(f"ringtrain train: error: rank {rt.rank}: {error}", file=sys.stderr, flush=True)
    return exit_code


def interrupted() -> int:
    """Ctrl-C outside the training loop (snapshots off, or while starting): a quiet exit.

    A launched worker says nothing: the launcher, interrupted too, says it stopped the workers.
    """
    if not in_launched_worker():
        print("ringtrain train: interrupted (SIGINT); nothing saved since the last snapshot",
              file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT_CODE


def stopped(stopped_by: str) -> int:
    """The exit code after every rank stopped on `stopped_by` and saved the same step.

    A launched worker exits with 143 whichever signal it was (the launcher's report knows it);
    a process alone says which: Ctrl-C is the user (130), SIGTERM or SIGUSR1 a scheduler that
    wants it requeued (143).
    """
    if in_launched_worker():
        return STOPPED_EXIT_CODE
    return INTERRUPTED_EXIT_CODE if stopped_by == "SIGINT" else REQUEUE_EXIT_CODE
