"""torch.distributed.elastic's internals: the agent and rendezvous steps ringtrain.launch changes.

- `matches_machine_hostname`, `RDZV_REGISTRY`: rendezvous across nodes
  (ringtrain.launch.rendezvous);
- `CAPTURE_PROCESS_FAILURES`, `running_workers`, `mark_finished`: tolerated ranks in
  `ringtrain run` (ringtrain.launch.launcher);
- `START_WORKERS`, `RESTART_WORKERS`, `set_remaining_restarts`: restarts counted for the job;
- `spawn_like`, `adopt`, `MONITOR_WORKERS`, `EXIT_BARRIER`, `sync_worker_ids`:
  a lost worker replaced in place (`ringtrain train --live`, ringtrain.launch.live_agent);
  `starting_workers_with`: workers forked from a warm process (ringtrain.launch.starts).

Each section says which names its feature needs and what it does without them
(`features.py`: how a name is looked up, a feature switched off, a `PatchPoint` replaced).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

from ringtrain.torch_internals.features import Feature, lookup, patch_point, set_by_init

# ---- rendezvous across nodes (ringtrain.launch.rendezvous) --------------------------------------

_HOSTNAME = Feature("telling the rendezvous host across nodes that it hosts the store "
                    "(ringtrain.launch.rendezvous)", None)
_matches_machine_hostname = lookup(
    "torch.distributed.elastic.rendezvous.utils._matches_machine_hostname", _HOSTNAME)


def matches_machine_hostname(host: str) -> bool:
    """Whether torch's rendezvous sees by itself that `host` names this machine.

    False where this torch has no such test: the caller then says `is_host` itself whenever the
    endpoint's address is one of ours, which is right either way.
    """
    return _matches_machine_hostname is not None and _matches_machine_hostname(host)


_RDZV = Feature("bounding the agent's rendezvous store queries across nodes "
                "(ringtrain.launch.rendezvous)",
                "across nodes, an agent whose rendezvous host is gone waits for torch's own "
                "timeouts instead of giving up after 30 s of silence")
#: The registry `elastic_launch` gets its rendezvous handler from.
RDZV_REGISTRY = patch_point("torch.distributed.launcher.api.rdzv_registry", _RDZV)


# ---- tolerated ranks in `ringtrain run` (ringtrain.launch.launcher) -----------------------------

_TOLERATE = Feature("tolerated ranks in `ringtrain run` (launch(..., tolerate_ranks=...), "
                    "ringtrain.launch.launcher), a lost worker replaced in place "
                    "(`ringtrain train --live`, ringtrain.launch.live_agent) and workers forked "
                    "from a warm process (ringtrain.launch.starts)",
                    "launch(..., tolerate_ranks=...) and --live are unavailable (they raise); "
                    "every worker starts as a fresh interpreter, as torchrun starts it")
_MP_API = "torch.distributed.elastic.multiprocessing.api"
#: `SubprocessContext._capture_process_failures(self, done_local_ranks)`: the step of the
#: agent's poll that records each exited worker as finished or failed.
CAPTURE_PROCESS_FAILURES = patch_point(f"{_MP_API}.SubprocessContext._capture_process_failures",
                                        _TOLERATE, raise_when_off=True)
for _name in ("_running_local_ranks", "subprocess_handlers", "envs"):
    set_by_init(CAPTURE_PROCESS_FAILURES.owner, _name, _TOLERATE)
_HANDLER = lookup("torch.distributed.elastic.multiprocessing.subprocess_handler."
                  "subprocess_handler.SubprocessHandler", _TOLERATE)
set_by_init(_HANDLER, "proc", _TOLERATE)


def running_workers(context: Any) -> list[tuple[int, int, subprocess.Popen]]:
    """(local rank, global rank, process) of each worker `context` still counts as running.

    Args:
        context: a `SubprocessContext`. Sorted by local rank; the global rank is the worker's
            RANK variable, -1 where it has none.
    """
    return [(local, int(context.envs[local].get("RANK", -1)),
             context.subprocess_handlers[local].proc)
            for local in sorted(context._running_local_ranks)]


def mark_finished(context: Any, local_rank: int) -> None:
    """Take `local_rank` off `context`'s running workers, so its poll never sees it exit."""
    context._running_local_ranks.discard(local_rank)


# ---- restarts counted for the job in `ringtrain run` (ringtrain.launch.launcher) ----------------

_RESTARTS = Feature("restarts counted for the whole job across nodes, not per node "
                    "(`ringtrain run --nnodes N --max-restarts M`, ringtrain.launch.launcher)",
                    "with --nnodes N --max-restarts M each node counts its own restarts, as "
                    "torch does (up to N x M in all)")
_AGENT = "torch.distributed.elastic.agent.server"
#: `LocalElasticAgent._start_workers(self, worker_group)`: after each rendezvous, starts the
#: workers with TORCHELASTIC_RESTART_COUNT = max_restarts - the agent's remaining restarts.
START_WORKERS = patch_point(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers",
                             _RESTARTS)
#: `SimpleElasticAgent._restart_workers(self, worker_group)`: stop, rendezvous again, start; called
#: after a failure (the group's state FAILED or UNHEALTHY) or when nodes wait to join (HEALTHY).
RESTART_WORKERS = patch_point(f"{_AGENT}.api.SimpleElasticAgent._restart_workers", _RESTARTS)
set_by_init(RESTART_WORKERS.owner, "_remaining_restarts", _RESTARTS)


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    """Set the restarts `agent` has left: its loop restarts after a failure while it is > 0."""
    agent._remaining_restarts = remaining


# ---- a lost worker replaced in `ringtrain train --live` (ringtrain.launch.live_agent) -----------

# Its process-context half is the tolerated ranks' feature (the same classes), its agent half
# the job's restarts' (the same agent); --live raises where either is off.
#: `SubprocessHandler._popen(self, args, env)`: how the handler starts its worker (`spawn_like`),
#: with its `_stdout` / `_stderr` files; replaced to fork workers from a warm process
#: (ringtrain.launch.starts), which starts them cold where this feature is off.
WORKER_POPEN = patch_point("torch.distributed.elastic.multiprocessing.subprocess_handler."
                           "subprocess_handler.SubprocessHandler._popen", _TOLERATE)
for _name in ("_stdout", "_stderr"):  # its output files (`starting_workers_with`)
    set_by_init(_HANDLER, _name, _TOLERATE)


#: `LocalElasticAgent._monitor_workers(self, worker_group)`: the agent's poll, which first checks
#: that its workers' ids are its process context's pids (a replaced worker's would not be).
MONITOR_WORKERS = patch_point("torch.distributed.elastic.agent.server.local_elastic_agent."
                              "LocalElasticAgent._monitor_workers", _RESTARTS,
                              raise_when_off=True)
set_by_init(MONITOR_WORKERS.owner, "_pcontext", _RESTARTS)
#: `SimpleElasticAgent._exit_barrier(self)`: once its workers succeeded, waits for every node's
#: agent (300 s); a live job waits only for those still up (`ringtrain.launch.live_store`).
EXIT_BARRIER = patch_point(f"{_AGENT}.api.SimpleElasticAgent._exit_barrier", _RESTARTS)


def sync_worker_ids(agent: Any, worker_group: Any) -> None:
    """Give `worker_group`'s workers the pids of `agent`'s processes now (after an `adopt`)."""
    pids = agent._pcontext.pids() if agent._pcontext is not None else {}
    for worker in worker_group.workers:
        if worker.local_rank in pids:
            worker.id = pids[worker.local_rank]


def spawn_like(context: Any, local_rank: int, env: dict[str, str]) -> subprocess.Popen:
    """`local_rank`'s command started once more as the agent started it (arguments, environment,
    output files, a session of its own; inside `starting_workers_with`, through its `start`),
    `env` on top; the agent sees it once `adopt`ed."""
    if WORKER_POPEN.owner is None:
        _TOLERATE.require()
    handler = context.subprocess_handlers[local_rank]
    return handler._popen(tuple(handler.proc.args),
                          {**os.environ, **context.envs[local_rank], **env})


@contextlib.contextmanager
def starting_workers_with(start: Callable[..., Any]) -> Iterator[None]:
    """Inside: torch's agent starts each worker's process as `start(popen, args, env, stdout,
    stderr)` returns it: `popen(args, env)` is torch's own start, stdout / stderr the worker's
    output files (None: the agent's own). Where the feature is off, torch's own start."""
    original = WORKER_POPEN.get()

    def popen(handler: Any, args: tuple, env: dict[str, str]) -> Any:
        return start(lambda a, e: original(handler, a, e), args, env, handler._stdout,
                     handler._stderr)

    with WORKER_POPEN.replaced(popen):
        yield


def adopt(context: Any, local_rank: int, proc: subprocess.Popen) -> None:
    """Make `proc` `local_rank`'s process: the agent's poll and teardown see it as that worker."""
    context.subprocess_handlers[local_rank].proc = proc


#: This module's features, in order (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_HOSTNAME, _RDZV, _TOLERATE, _RESTARTS]
