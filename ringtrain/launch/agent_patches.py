"""What ringtrain changes in torch's elastic agent, each change one context manager.

`launcher.py` (`ringtrain run`) runs torch's agent as it is, inside these: `tolerating` lets
chosen ranks die without stopping the others (async parameter-server workers),
`restarts_for_the_job` makes --max-restarts count the job's restarts across nodes instead of
each node's own, and `naming_failures_before_restarts` says which rank failed and why before
each restart. Each replaces a step of the agent for the duration of one launch, through the
patch points of `ringtrain.torch_internals` (looked up once at import: a torch without one
switches off only that feature, and says so); nothing is changed outside the `with` block.

Kept apart from the launcher because this is the code that depends on torch's private agent
internals: on a torch upgrade it is the one file to read again.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Collection, Iterator

from torch.distributed.elastic.agent.server import WorkerState
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ringtrain.launch.failure_report import STOPPED_EXIT_CODE, format_failure, root_message
from ringtrain.launch.peer_failure import PEER_FAILED_EXIT_CODE
from ringtrain.torch_internals import (
    CAPTURE_PROCESS_FAILURES,
    MONITOR_WORKERS,
    RESTART_WORKERS,
    START_WORKERS,
    TorchInternalsError,
    mark_finished,
    running_workers,
    set_remaining_restarts,
)

__all__ = ["RESTARTS_KEY", "naming_failures_before_restarts", "restarts_for_the_job",
           "tolerated_exit", "tolerating"]


def tolerated_exit(exitcode: int) -> bool:
    """Whether a tolerated rank's exit code is its own death (not a stop the job asked for).

    Exits that say "a peer failed" (the watchdog's) or "stopped on SIGTERM" (a snapshot was
    saved, or the agent is tearing down) belong to the whole job: they are never tolerated.
    """
    return exitcode not in (0, PEER_FAILED_EXIT_CODE, STOPPED_EXIT_CODE, -signal.SIGTERM)


@contextlib.contextmanager
def tolerating(ranks: Collection[int]) -> Iterator[None]:
    """Inside: a tolerated global rank's own death is a warning, not a failure of the job.

    torch's agent polls its `SubprocessContext`, which records every non-zero exit as a
    failure and then stops every worker. Here the recording step is wrapped: a tolerated
    rank that died is logged and taken off the running ranks as if it had finished, so the
    others run on and the job succeeds if they do. Relies on torch internals (the recording
    step and the context's running workers), taken through `ringtrain.torch_internals`, which
    checks them at import; functions launched in-process (`launch(fn)`) use another context
    and are not covered.
    """
    if not ranks:
        yield
        return
    original = CAPTURE_PROCESS_FAILURES.get()
    tolerated = frozenset(ranks)

    def capture(self, done_local_ranks: set[int]) -> None:
        for local_rank, rank, proc in running_workers(self):
            exitcode = proc.poll()
            if rank in tolerated and exitcode is not None and tolerated_exit(exitcode):
                mark_finished(self, local_rank)  # torch's step never sees it
                done_local_ranks.add(local_rank)
                how = (f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0
                       else f"exit code {exitcode}")
                print(f"ringtrain run: warning: rank {rank} (local_rank {local_rank}, pid "
                      f"{proc.pid}) died ({how}); it is a tolerated rank, the others go on",
                      file=sys.stderr, flush=True)
        original(self, done_local_ranks)

    with CAPTURE_PROCESS_FAILURES.replaced(capture):
        yield


RESTARTS_KEY = "ringtrain/restarts"  # in the rendezvous store: the job's restarts after failures


@contextlib.contextmanager
def restarts_for_the_job() -> Iterator[None]:
    """Inside: --max-restarts and TORCHELASTIC_RESTART_COUNT count the job's restarts, not a node's.

    torch's agent counts the failures its own node saw (pytorch/pytorch#108158): the failed
    node's workers see restart count 1, the others 0, and N nodes restart up to N x
    --max-restarts times. Here the first agent to restart after attempt n failed counts it in the
    rendezvous store; every agent, after the rendezvous, starts its workers with that count
    (restarts because a node joined are not counted, as in torch)."""
    start, restart = START_WORKERS.get(), RESTART_WORKERS.get()
    seen = [0]  # the count this agent's workers were started with

    def job_store(group):  # the rendezvous store without this round's prefix
        return getattr(group.store, "underlying_store", group.store)

    def start_workers(self, worker_group):
        seen[0] = int(job_store(worker_group).add(RESTARTS_KEY, 0))
        set_remaining_restarts(self, worker_group.spec.max_restarts - seen[0])
        return start(self, worker_group)

    def restart_workers(self, worker_group):
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            store = job_store(worker_group)  # the peers' workers fail too: count attempt n once
            if store.add(f"{RESTARTS_KEY}/after/{seen[0]}", 1) == 1:
                store.add(RESTARTS_KEY, 1)
        return restart(self, worker_group)

    with START_WORKERS.replaced(start_workers), RESTART_WORKERS.replaced(restart_workers):
        yield


class _DropTorchsRestartNotice(logging.Filter):
    def filter(self, entry: logging.LogRecord) -> bool:
        return "attempts left" not in str(entry.msg)


@contextlib.contextmanager
def naming_failures_before_restarts(max_restarts: int,
                                    causes: list[str] | None = None) -> Iterator[None]:
    """Inside: before the agent restarts its workers after a failure, the launcher says which
    rank failed and why (the report `ringtrain run` prints when no restart is left, from the
    failures of the agent's last poll) and which restart this is; `causes` gets each restarted
    attempt's failure in a line (`root_message`), for the report at the end. torch's agent logs only
    "Worker group FAILED. 1/1 attempts left; will restart worker group", which this replaces.
    A node whose workers restart only because another node's failed (state HEALTHY: a new
    rendezvous) says nothing; the failing node says it."""
    try:
        monitor, restart = MONITOR_WORKERS.get(), RESTART_WORKERS.get()
    except TorchInternalsError:  # this torch lacks the agent's steps: torch's own notice stays
        monitor = restart = None
    if monitor is None or restart is None:
        yield
        return
    seen: list[dict] = []  # the failures of the last poll that found any
    restarts = [0]

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.failures:
            seen[:] = [result.failures]
        return result

    def restart_workers(self, worker_group):
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and seen:
            restarts[0] += 1
            failures = seen.pop()
            if causes is not None:
                causes.append(root_message(failures))
            report = format_failure(ChildFailedError("worker", failures))
            print(f"{report}\nringtrain run: restarting every worker (restart {restarts[0]} of "
                  f"--max-restarts {max_restarts})", file=sys.stderr, flush=True)
        return restart(self, worker_group)

    notice = logging.getLogger("torch.distributed.elastic.agent.server.api")
    drop = _DropTorchsRestartNotice()
    notice.addFilter(drop)
    try:
        with MONITOR_WORKERS.replaced(monitor_workers), RESTART_WORKERS.replaced(restart_workers):
            yield
    finally:
        notice.removeFilter(drop)

