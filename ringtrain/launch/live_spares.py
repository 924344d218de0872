"""How a live job's agent starts a process again: warm spares, and forks of a warm process.

- `Starts`: a lost worker's replacement, or a new warm spare, is the worker's command started
  once more. Once the job may start one (warm spares, or a first replacement) the agent starts a
  zygote (`zygote.py`): a process that runs the worker's interpreter with its environment and
  imports torch, torch._dynamo and the worker's code, then forks a copy per start, which only
  builds its model and joins (measured alone: a whole `ringtrain train --steps 1` ran in 1.8 s
  forked against 6.9 s cold; a cold spare at nice 19 on cores the job kept busy took ~30 s).
  Whatever the zygote cannot do (not ready yet, not Linux, a command that is not `python [-u]
  -m MODULE` or a script, a thread or CUDA in it) starts the process as torch's agent started
  it (`spawn_like`), as before, and says why once. Under `--memory-limit` the worker's command is
  `memory_exec.py`'s; a fork joins the memory cgroup that file would have joined
  (`memory_exec.cgroup_procs`) before it runs: the pages it shares with the zygote (torch's
  code and import-time data, copy-on-write) stay charged to the zygote's, what it allocates
  to its own.
- `Spares`: the warm spares an agent owns (`ringtrain train --live-spares N`), kept at N until
  the job ends (see `live_agent.py`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from ringtrain.launch import memory_exec
from ringtrain.launch.cgroup import SLOT_ENV, CgroupUnavailable, MemoryCgroups
from ringtrain.launch.live_store import StoreWatch
from ringtrain.launch.zygote import Zygote, ZygoteError, forkable
from ringtrain.torch_internals import spawn_like, worker_command

__all__ = ["REPLACEMENT_ENV", "SPARE_ENV", "Spares", "Starts"]

REPLACEMENT_ENV = "RINGTRAIN_LIVE_REPLACEMENT"  # set in a replacement: which one it is (1, 2..)
SPARE_ENV = "RINGTRAIN_LIVE_SPARE"  # set in a warm spare: it waits, built, for a lost member
# What a fork finds imported: torch, the compiler stack torch.optim imports on the first
# optimizer's add_param_group (1.8 s), and `ringtrain train`'s own modules.
PRELOAD = ("torch", "torch._dynamo", "torch.optim")
PRELOAD_RINGTRAIN = ("ringtrain.cli.train",)
READY_WITHIN_S = 120.0  # a zygote not ready by then is given up (its imports hang)


class Starts:
    """The agent's way to start a worker's command again (`start`); `fork=False`: always as
    torch's agent started it."""

    def __init__(self, fork: bool = True):
        self.fork = fork
        self.zygote: Zygote | None = None
        self.since = 0.0
        self.off: str | None = None if fork else "off"  # why no fork any more

    def warm(self, context: Any) -> None:
        """Start the zygote now if it is not started (never blocks)."""
        if self.off is not None or self.zygote is not None:
            return
        command = worker_command(context, 0, {})
        args, env, _ = _unwrapped(command.args, command.env)  # memory_exec's MALLOC_ENV in env
        parsed = forkable(args)
        if parsed is None:
            self._give_up(f"the workers' command is not `python -m MODULE` or a script: "
                          f"{list(command.args)[:4]}")
            return
        preload = PRELOAD + (PRELOAD_RINGTRAIN if parsed[1] == ("module", "ringtrain") else ())
        try:
            self.zygote = Zygote(parsed[0], env, preload)
        except (ZygoteError, OSError) as e:
            self._give_up(str(e))
            return
        self.since = time.monotonic()

    def warming(self) -> bool:
        """Whether a zygote is started and still importing (a start now would be cold)."""
        if self.zygote is None or self.off is not None or self.zygote.ready():
            return False
        if self.zygote.proc.poll() is not None:
            self._give_up(f"the warm process exited with {self.zygote.proc.returncode} before "
                          "it was ready")
            return False
        if time.monotonic() - self.since > READY_WITHIN_S:
            self._give_up(f"the warm process was not ready within {READY_WITHIN_S:g} s")
            return False
        return True

    def start(self, context: Any, local_rank: int, env: dict[str, str]
              ) -> tuple[subprocess.Popen, bool]:
        """`local_rank`'s command started once more, `env` on top: (process, forked). Cold
        while the zygote still imports: a process is wanted now, not once it is ready."""
        self.warm(context)
        self.warming()  # gives up a zygote that exited or hangs, saying so
        if self.zygote is not None and self.off is None and self.zygote.ready():
            command = worker_command(context, local_rank, env)
            args, full_env, cgroup = _unwrapped(command.args, command.env)
            try:
                return self.zygote.fork(args, full_env, stdout=command.stdout,
                                        stderr=command.stderr, cgroup_procs=cgroup), True
            except (ZygoteError, OSError) as e:
                self._give_up(str(e))
        return spawn_like(context, local_rank, env), False

    def _give_up(self, why: str) -> None:
        print(f"ringtrain run: live: new processes start cold (imports first, ~4.5 s of a "
              f"core each), not forked from a warm process: {why}", file=sys.stderr, flush=True)
        self.off = why
        self.close()

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


def _unwrapped(args: tuple[str, ...], env: dict[str, str]
               ) -> tuple[list[str], dict[str, str], str | None]:
    """(command, environment, cgroup.procs to join or None): `memory_exec.py`'s command is the
    `python -m ringtrain` it execs, with the cgroup it joins first."""
    args = [str(a) for a in args]
    parsed = forkable(args)
    if parsed is None or parsed[1] != ("script", memory_exec.__file__):
        return args, env, None
    return ([*parsed[0], "-m", "ringtrain", *parsed[2][1:]],
            {**memory_exec.MALLOC_ENV, **env}, memory_exec.cgroup_procs(env))


class Spares:
    """The warm spares this agent owns: the workers' command started again (`Starts`: forked
    where it can, else as a worker is), kept at `count` until the job ends; under `memory`
    (`--memory-limit`), each in a memory cgroup of its own (`MemoryCgroups.add_spare`)."""

    def __init__(self, count: int, starts: Starts, memory: MemoryCgroups | None = None):
        self.count, self.started, self.starts, self.memory = count, 0, starts, memory
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
        spares start cold (the zygote starts with them and imports meanwhile): forked once it
        is ready they were built later than the workers, and a fault in the first steps found
        none waiting (seen under load in tests/test_live_train.py)."""
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
        self.starts.warm(context)
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
            proc, forked = self.starts.start(context, local, env)
            self.procs.append((proc, time.monotonic(), cgroup, forked))

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
