"""A live job's warm spares (`ringtrain train --live-spares N`), kept at N until the job ends.

A lost worker's replacement, or a new warm spare, is the worker's command started once more as
torch's agent starts its workers (`spawn_like`, through `starts.forked_worker_starts`): a fork
of the job's warm process where it can be (`starts.py`), which only builds its model and joins
(measured alone: a whole `ringtrain train --steps 1` ran in 1.8 s forked against 6.9 s cold; a
cold spare at nice 19 on cores the job kept busy took ~30 s). See `live_agent.py` for how the
agent uses them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from ringtrain.launch.cgroup import SLOT_ENV, CgroupUnavailable, MemoryCgroups
from ringtrain.launch.live_store import StoreWatch
from ringtrain.launch.starts import forked
from ringtrain.torch_internals import spawn_like

__all__ = ["REPLACEMENT_ENV", "SPARE_ENV", "Spares"]

REPLACEMENT_ENV = "RINGTRAIN_LIVE_REPLACEMENT"  # set in a replacement: which one it is (1, 2..)
SPARE_ENV = "RINGTRAIN_LIVE_SPARE"  # set in a warm spare: it waits, built, for a lost member
class Spares:
    """The warm spares this agent owns: the workers' command started again as a worker is
    (forked where the job forks), kept at `count` until the job ends; under `memory`
    (`--memory-limit`), each in a memory cgroup of its own (`MemoryCgroups.add_spare`)."""

    def __init__(self, count: int, memory: MemoryCgroups | None = None):
        self.count, self.started, self.memory = count, 0, memory
        # (process, started at, its memory cgroup's name or None, forked)
        self.procs: list[tuple[subprocess.Popen, float, str | None, bool]] = []
        self.over = False  # a spare exited 0: the job is done, none is started any more

    def take(self) -> tuple[subprocess.Popen, float, str | None, bool] | None:
        """A running spare, handed over (it goes into a lost worker's slot)."""
        for item in self.procs:
            if item[0].poll() is None:
                self.procs.remove(item)
                return item
        return None

    def keep_up(self, context: Any, departed: StoreWatch, may_start) -> None:
        """Restart the spares that died; start the missing ones while `may_start()` (it counts
        every start after the first `count` against the job's replacements). The job's first
        spares start one poll after its workers, from the same warm process."""
        for item in [i for i in self.procs if i[0].poll() is not None]:
            self.procs.remove(item)
            proc = item[0]
            if proc.returncode == 0:
                self.over = True
                continue
            departed.mark(proc.pid)
            print(f"ringtrain run: live: warm spare (pid {proc.pid}) exited with "
                  f"{proc.returncode} while it waited; starting another", file=sys.stderr,
                  flush=True)
        while not self.over and len(self.procs) < self.count and \
                (self.started < self.count or may_start()):
            local = self.started % len(context.envs)  # one slot's environment, in turn
            self.started += 1
            env = {REPLACEMENT_ENV: f"spare-{self.started}", SPARE_ENV: "1"}
            cgroup = None
            if self.memory is not None:  # never a running worker's: its own, the same limit
                try:
                    cgroup = env[SLOT_ENV] = self.memory.add_spare(self.started)
                except CgroupUnavailable as e:  # a spare outside the limit is what it bounds
                    print(f"ringtrain run: live: no warm spare is started: {e}",
                          file=sys.stderr, flush=True)
                    self.over = True
                    return
            proc = spawn_like(context, local, env)
            self.procs.append((proc, time.monotonic(), cgroup, forked(proc)))

    def close(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the spares to exit (a finished job tells them), then kill
        them: a spare holds nothing to save. No process is left either way."""
        deadline = time.monotonic() + grace_s
        for proc, *_ in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session
                proc.wait(timeout=10)
        self.procs.clear()
        self.over = True
