"""How the agent starts a worker: forked from a warm process that imported torch once.

    with forked_worker_starts():        # around elastic_launch (`ringtrain run`, `train`)
        elastic_launch(config, cmd)(*args)

A cold `python -u -m ringtrain train` spends ~6 s of a core before it builds anything: torch
(~3 s) and the compiler stack torch.optim imports on the first optimizer's add_param_group
(~2.8 s), measured here with torch 2.13 on CPU. Every worker paid it at the job's start and
again at each restart (`--max-restarts`), and a live job's replacements and spares too. Inside
`forked_worker_starts` the agent's first worker start starts a zygote (`zygote.py`): a process
of the workers' interpreter and environment that imports `PRELOAD` and `ringtrain train`'s
code, then forks a copy per start, which only builds its model and joins. The first start
waits for it (~6 s, about what a cold start costs alone; the job's CPU for the imports is paid
once, not once per worker); every later start, a restart's or a live replacement's, is a fork
(~20-50 ms, then the worker's own work: a whole `ringtrain train --steps 1` measured 1.8 s
forked against 6.9 s cold).

What is forked: `ringtrain train`'s workers (`python -u -m ringtrain`: ringtrain's own code,
which ends its process itself, `ending.py`), and in a live job any `python -m MODULE` or
`python SCRIPT` (its replacements and spares). A user's script in any other job starts as
torchrun starts it: a fork would differ from a fresh interpreter where a script can see it
(its `atexit` handlers and interpreter shutdown, environment variables a preloaded library
read as it loaded, such as OMP_NUM_THREADS set in the script before `import torch`). Whatever
the zygote cannot do starts the worker cold too: `--no-python`, `--run-path`, a NUMA-bound
command, not Linux, a zygote that exited, hangs in its imports or refuses (a thread, or CUDA,
in it), `--memory-limit` (a fork's pages shared with the zygote, torch's code and import-time
data, would be charged to the zygote's memory cgroup, not the worker's: the limit would bound
~300 MB less than the worker uses); a live job says why once. `--cold-starts` turns forks off.

Where the launcher knows the workers' command before its agent starts (`ringtrain run` and
`train`), the zygote is a fork of the launcher itself (`Zygote.forked_here`), which imported
torch already: it only imports the rest (a `ringtrain train` job measured 6.05 s against 8.04 s
wall, 6.8 s against 8.6 s of CPU, `--steps 10` on 2 processes, 4 runs each, session 23). Where
it cannot be (a thread already runs, another Python, interpreter options the workers lack), the
first start starts one fresh, as above.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from ringtrain.launch import memory_exec
from ringtrain.launch.zygote import ForkedProcess, Zygote, ZygoteError, forkable
from ringtrain.torch_internals import starting_workers_with

__all__ = ["PRELOAD", "Starts", "forked", "forked_worker_starts"]

# What a fork finds imported: torch, the compiler stack torch.optim imports on the first
# optimizer's add_param_group (~2.8 s), and `ringtrain train`'s own modules for its workers.
PRELOAD = ("torch", "torch._dynamo", "torch.optim")
PRELOAD_RINGTRAIN = ("ringtrain.cli.train",)
READY_WITHIN_S = 120.0  # a zygote not ready by then is given up (its imports hang)


class Starts:
    """One job's worker starts (`start`): forked from its zygote where they can be, else cold.

    `fork=False`: always cold. `live`: a live job's, which forks any forkable command (else
    only `python -m ringtrain`, see the module) and says once why its starts are cold.
    `command` and `env`, the workers' command and this process's environment, known before the
    agent starts: the zygote is forked from this process at once, before the agent's threads
    (`Zygote.forked_here`: torch is not imported a second time), where it can be; else the
    first start starts one as a fresh interpreter.
    """

    def __init__(self, fork: bool = True, live: bool = False,
                 command: list[str] | None = None, env: dict[str, str] | None = None):
        self.zygote: Zygote | None = None
        self.off: str | None = None if fork else "off"  # why no fork any more
        self.live = live
        parsed = forkable(command) if fork and command is not None else None
        if parsed is not None and self._why_cold(parsed) is None:
            try:
                self.zygote = Zygote.forked_here(parsed[0], os.environ if env is None else env,
                                                 self._preload(parsed))
            except (ZygoteError, OSError):
                self.zygote = None  # the first start starts one as before

    def start(self, popen: Any, args: tuple[str, ...], env: dict[str, str], stdout: Any,
              stderr: Any) -> Any:
        """The process of `args` in `env` (the full environment) writing to stdout / stderr
        (files or None): a fork, or `popen(args, env)` (torch's start) where none can be."""
        command = [str(a) for a in args]
        if self.off is None and self._ready(command, env):
            try:
                return self.zygote.fork(command, env, stdout=stdout, stderr=stderr)
            except (ZygoteError, OSError) as e:  # OSError: the fork gone before it was checked
                self._give_up(str(e))
        return popen(args, env)

    def _why_cold(self, parsed: tuple) -> str | None:
        """Why a command (`forkable`'s parse) starts cold in this job, or None."""
        if parsed[1] == ("script", memory_exec.__file__):
            return ("under --memory-limit a fork's pages shared with the warm process would be "
                    "charged to the warm process's cgroup, not the worker's")
        if parsed[1] != ("module", "ringtrain") and not self.live:
            return "a user's program outside a live job starts as torchrun starts it"
        return None

    @staticmethod
    def _preload(parsed: tuple) -> tuple[str, ...]:
        return PRELOAD + (PRELOAD_RINGTRAIN if parsed[1] == ("module", "ringtrain") else ())

    def _ready(self, command: list[str], env: dict[str, str]) -> bool:
        """Start the zygote for `command` if none runs, and wait until it forks (or is given
        up: then False)."""
        parsed = forkable(command)
        if parsed is None:
            self._give_up(f"the workers' command is not `python -m MODULE` or a script: "
                          f"{command[:4]}")
            return False
        if (why := self._why_cold(parsed)) is not None:
            self._give_up(why)
            return False
        if self.zygote is not None and self.zygote.interpreter != parsed[0]:
            self.close()  # forked for another command than the agent's: start the right one
        if self.zygote is None:
            try:
                self.zygote = Zygote(parsed[0], env, self._preload(parsed))
            except (ZygoteError, OSError) as e:
                self._give_up(str(e))
                return False
        if self.zygote.wait_ready(READY_WITHIN_S):
            return True
        code = self.zygote.proc.poll()
        self._give_up(f"the warm process exited with {code}" if code is not None else
                      f"the warm process was not ready within {READY_WITHIN_S:g} s")
        return False

    def _give_up(self, why: str) -> None:
        if self.live:
            print(f"ringtrain run: workers start cold (imports first, ~6 s of a core each), "
                  f"not forked from a warm process: {why}", file=sys.stderr, flush=True)
        self.off = why
        self.close()

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


def forked(proc: Any) -> bool:
    """Whether `proc` (a worker's process) was forked from the zygote."""
    return isinstance(proc, ForkedProcess)


@contextlib.contextmanager
def forked_worker_starts(fork: bool = True, live: bool = False,
                         command: list[str] | None = None,
                         env: dict[str, str] | None = None) -> Iterator[Starts]:
    """Inside: torch's agent starts each worker through one `Starts` (see the module); the
    zygote is closed on the way out (the workers it forked are the agent's children).
    `command`, `env`: the workers' command and environment where known (see `Starts`)."""
    starts = Starts(fork, live, command, env)
    try:
        with starting_workers_with(starts.start):
            yield starts
    finally:
        starts.close()
