"""`ringtrain run`: torchrun's flags on torch's own elastic agent, with one readable failure report.

    ringtrain run --nproc-per-node 2 train.py --lr 3e-4
    ringtrain run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 train.py   # on each node
    ringtrain run --help

Parsing, rendezvous, worker start-up, monitoring and teardown are torch's
(`torch.distributed.run` / `elastic_launch`); this file only
- picks a free port by itself on a single node (two jobs at once never collide), and across
  nodes advertises an address the others can reach (`ringtrain.launch.rendezvous`),
- polls the workers every 0.1 s, so a dead worker stops the rest promptly,
- replaces torch's multi-page error dump by one block: which rank failed first, its exit code
  or signal, and its traceback (`ringtrain.launch.failure_report`; the traceback is written by
  workers whose main is decorated with `record`),
- keeps workers from outliving a SIGKILLed launcher (`ringtrain.launch.parent`, called in the
  worker),
- passes SIGUSR1 on too (Slurm's `--signal=USR1@90`), giving the workers `--shutdown-timeout`
  seconds to save, and then exits with 143 ("requeue me", `ringtrain.errors.REQUEUE_EXIT_CODE`),
- across nodes, counts restarts for the job, not per node (`agent_patches.restarts_for_the_job`),
- lets chosen ranks die without stopping the others (`launch(..., tolerate_ranks=...)`, used by
  `ringtrain train --strategy ps --ps-mode async` for its workers other than rank 0),
- in live mode (`launch(..., live=True)`, `ringtrain train --live`) replaces a lost worker in
  place while the others go on, and kills one its peers found hung (`live_agent.py`),
- starts `ringtrain train`'s workers (and a live job's replacements) as forks of a warm process
  that imported torch once for the job, not as fresh interpreters (`starts.py`;
  `--cold-starts`: torchrun's way).

    from ringtrain.launch.launcher import record
    @record                          # the launcher then prints this worker's traceback
    def main(): ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Collection, Iterator

import torch
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from ringtrain.errors import DISK_FULL_EXIT_CODE, REQUEUE_EXIT_CODE, USAGE_EXIT_CODE
from ringtrain.launch.agent_patches import (
    naming_failures_before_restarts,
    restarts_for_the_job,
    tolerating,
)
from ringtrain.launch.cgroup import MemoryCgroups
from ringtrain.launch.device import gpu_checks_through_nvml, launcher_gpu_count
from ringtrain.launch.entrypoint import missing_entrypoint
from ringtrain.launch.environments import LAUNCHER_PID_ENV
from ringtrain.launch.failure_report import (
    _REPEATED_BY_REPORT,
    STOPPED_EXIT_CODE,
    explained_by_workers,
    format_failure,
    root_cause,
    root_message,
    same_every_attempt,
)
from ringtrain.launch.live_agent import (
    LiveJobFailedError,
    LiveStoreLostError,
    replacing_lost_workers,
)
from ringtrain.launch.process_group import WATCHDOG_ENV
from ringtrain.launch.rendezvous import (
    _bounded_rendezvous,
    _multi_node_addresses,
    _single_node_rendezvous,
    backend_missing,
    port_in_use,
)
from ringtrain.launch.run_args import get_args_parser, has_shutdown_timeout
from ringtrain.launch.starts import forked_worker_starts

__all__ = ["ChildFailedError", "format_failure", "get_args_parser", "launch",
           "main", "record", "root_cause"]

_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class _Curate(logging.Filter):
    """Keep torch's warnings and errors except those the report repeats; keep restart notices."""

    def filter(self, entry: logging.LogRecord) -> bool:
        msg = str(entry.msg)
        if "attempts left" in msg:  # INFO, but news (where naming_failures_before_restarts does
            # not run: this torch lacks the agent steps it replaces)
            return True
        return entry.levelno >= logging.WARNING and not any(s in msg for s in _REPEATED_BY_REPORT)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Curate torch's launcher logs (see `_Curate`), unless the user asked for LOGLEVEL."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    loggers = [logging.getLogger(name) for name in (
        "torch.distributed.run", "torch.distributed.launcher.api",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in loggers]
    curate = _Curate()
    for logger in loggers:
        logger.addFilter(curate)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))  # let the filter decide
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeFilter(curate)
            logger.setLevel(level)


def _run(args, entrypoint: Callable | str | None = None, entry_args: list | None = None,
         tolerate_ranks: Collection[int] = (), live: bool = False, live_spares: int = 0,
         memory: MemoryCgroups | None = None) -> int:
    """Launch from parsed torchrun arguments; the entrypoint may be replaced by a function.

    `tolerate_ranks`: global ranks whose own death does not stop the others (`tolerating`).
    `live`: a lost worker is replaced in place (`replacing_lost_workers`), by one of
    `live_spares` warm spares where one waits (each in a cgroup of its own beside `memory`'s).
    """
    if entrypoint is None and (missing := missing_entrypoint(args.training_script, args.module,
                                                             args.no_python)):
        print(f"ringtrain run: error: {missing}", file=sys.stderr)
        return 2
    if args.nproc_per_node == "gpu" and launcher_gpu_count() == 0:  # torch: "Cuda is not ..."
        build = "" if torch.version.cuda else " (a CPU-only build)"
        print(f"ringtrain run: error: --nproc-per-node gpu: torch {torch.__version__}{build} "
              "sees no GPU on this machine; give a number of processes, or auto (one per GPU, "
              "else one per CPU core)", file=sys.stderr)
        return 2
    try:
        _single_node_rendezvous(args)
        _multi_node_addresses(args)
        with _quiet_torch_logs(), gpu_checks_through_nvml():  # the warm process is a fork
            config, cmd, cmd_args = config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        print(f"ringtrain run: error: {e}", file=sys.stderr)
        return 2
    if entrypoint is not None:
        cmd, cmd_args = entrypoint, list(entry_args or [])
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    share_store = os.environ.get(_SHARE_STORE_ENV)
    if args.max_restarts > 0 and share_store is None:
        # torch's c10d rendezvous hands every attempt the same agent-hosted TCPStore, and the
        # process group's keys carry no attempt number: a restarted worker can read the dead
        # attempt's gloo/NCCL addresses and fail to connect (pytorch/pytorch#135712). Without
        # the sharing, each attempt's rank 0 hosts a fresh store.
        os.environ[_SHARE_STORE_ENV] = "1"
    # The agent installs handlers for these (raising SignalException); put ours back after.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                 signal.SIGQUIT, signal.SIGUSR1)}
    multi_node = int(str(args.nnodes).split(":")[-1]) > 1
    causes: list[str] = []  # each restarted attempt's failure (naming_failures_before_restarts)
    try:
        with contextlib.ExitStack() as stack:
            # First: its warm process is forked from this one before anything starts a thread.
            stack.enter_context(forked_worker_starts(
                fork=not args.cold_starts, live=live, env=dict(os.environ),
                command=[cmd, *cmd_args] if isinstance(cmd, str) else None))
            stack.enter_context(_quiet_torch_logs())
            stack.enter_context(tolerating(tolerate_ranks))
            if live:
                stack.enter_context(replacing_lost_workers(spares=live_spares, memory=memory))
            elif args.max_restarts > 0:
                stack.enter_context(naming_failures_before_restarts(args.max_restarts, causes))
            if multi_node:
                stack.enter_context(_bounded_rendezvous(config.rdzv_endpoint, live=live))
                stack.enter_context(restarts_for_the_job())
            elastic_launch(config, cmd)(*cmd_args)
        return 0
    except ChildFailedError as e:
        if explained_by_workers(e.failures):  # a user mistake, which rank 0 has printed once
            return USAGE_EXIT_CODE
        codes = {f.exitcode for f in e.failures.values()}
        if DISK_FULL_EXIT_CODE in codes and codes <= {DISK_FULL_EXIT_CODE, -signal.SIGTERM}:
            return DISK_FULL_EXIT_CODE  # stopped at their last snapshot; rank 0 said why
        print(format_failure(e), file=sys.stderr, flush=True)
        if said := same_every_attempt(causes, root_message(e.failures)):
            print(said, file=sys.stderr, flush=True)
        # The workers stopped on SIGTERM after saving (a slow one may have been stopped by the
        # agent itself): say so with the same code, not 1.
        if STOPPED_EXIT_CODE in codes and codes <= {STOPPED_EXIT_CODE, -signal.SIGTERM}:
            return STOPPED_EXIT_CODE
        return 1
    except SignalException as e:  # the agent already stopped the workers with the same signal
        return _stopped_by(e)
    except KeyboardInterrupt:  # Ctrl-C before the agent's handler was in place; it stopped them
        print("ringtrain run: got SIGINT; stopped all workers", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except (LiveStoreLostError, LiveJobFailedError) as e:  # this node's workers are stopped
        # (another node's failure, or the store's silence); the message says why and what to do
        print(f"ringtrain run: live: {e}", file=sys.stderr, flush=True)
        return 1
    except RendezvousConnectionError as e:
        cause = e.__cause__ or e
        print(f"ringtrain run: cannot reach the rendezvous store at {config.rdzv_endpoint} "
              "(--rdzv-endpoint): its node died, is unreachable or has not started; stopped the "
              "workers here "
              f"({str(cause).splitlines()[0] if str(cause) else type(cause).__name__})",
              file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # rendezvous timeouts and the like: one line, not a stack
        if (signalled := _signal_behind(e)) is not None:
            return _stopped_by(signalled)
        if said := port_in_use(e, args) or backend_missing(e, args):  # no worker started
            print(f"ringtrain run: error: {said}", file=sys.stderr, flush=True)
            return USAGE_EXIT_CODE
        print(f"ringtrain run: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if share_store is None:
            os.environ.pop(_SHARE_STORE_ENV, None)
        for s, h in handlers.items():  # the agent replaced them; `launch` may be called again
            if h is not None:
                with contextlib.suppress(ValueError):  # not on the main thread
                    signal.signal(s, h)


def _stopped_by(e: SignalException) -> int:
    name = signal.Signals(e.sigval).name
    print(f"ringtrain run: got {name}; stopped all workers", file=sys.stderr, flush=True)
    if e.sigval in (signal.SIGTERM, signal.SIGUSR1):  # a scheduler's: requeue the job
        return REQUEUE_EXIT_CODE
    return 128 + int(e.sigval)


def _signal_behind(error: BaseException | None) -> SignalException | None:
    """The agent's SignalException that `error` was raised over, if any.

    torch's `elastic.metrics.prof`, around each of the agent's steps (its monitoring, every poll),
    sets its timer inside its `try`; a signal handled right there (the main thread switching
    threads after `time.time()`, under load) raises "UnboundLocalError: cannot access local
    variable 'start'" from its `finally`, over the SignalException (torch 2.13; 1 SIGTERM in
    ~30 of tests/test_live_zero.py's, under two CPU burners). The agent still stopped the
    workers: `run()`'s `finally` does."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SignalException):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def main(argv: list[str]) -> int:
    """`ringtrain run ARGS`; returns the exit code.

    0 when every worker succeeded, 1 when one failed (reported on stderr), 2 for bad flags or
    when the workers exited with 2 (a mistake they explained: no report), 128 + N when the
    launcher got signal N (the workers are stopped first), 143 ("requeue me") after SIGTERM or
    SIGUSR1, or when every worker exited with 143 (`ringtrain train` workers do after saving a
    snapshot on SIGTERM, SIGUSR1 or SIGINT), 74 when they exited with 74 (`ringtrain train`:
    the run directory is full; rank 0 said so).
    """
    parser = get_args_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    if args.watchdog_timeout < 0:
        print(f"ringtrain run: error: --watchdog-timeout {args.watchdog_timeout:g}: it must be "
              ">= 0 (0 turns the watchdog off)", file=sys.stderr)
        return 2
    previous = os.environ.get(WATCHDOG_ENV)
    os.environ[WATCHDOG_ENV] = str(args.watchdog_timeout)  # read by init_distributed in workers
    try:
        return _run(args)
    finally:
        if previous is None:
            os.environ.pop(WATCHDOG_ENV, None)
        else:
            os.environ[WATCHDOG_ENV] = previous


def launch(
    entrypoint: str | Callable,
    args: list[str],
    *,
    nproc_per_node: int,
    nnodes: str = "1",
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    run_id: str | None = None,
    module: bool = False,
    tolerate_ranks: Collection[int] = (),
    shutdown_timeout: int | None = None,
    live: bool = False,
    live_spares: int = 0,
    memory: MemoryCgroups | None = None,
    cold_starts: bool = False,
) -> int:
    """Run `entrypoint` on `nproc_per_node` workers here (and join `nnodes` nodes); return the
    exit code.


    Args:
        entrypoint: a script path (run as `python -u script *args`), a module name with
            `module=True` (`python -u -m module *args`, e.g. "ringtrain" with ["train", ...]),
            or a picklable module-level function called as `fn(*args)` in each worker.
        args: the entrypoint's arguments.
        nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, max_restarts,
            monitor_interval, run_id: torchrun's flags of the same names. A single node without
            `rdzv_endpoint` picks a free port; several nodes need `rdzv_endpoint` (host:port
            of node 0) and the same `run_id` on every node.
        shutdown_timeout: seconds the workers get to exit after SIGTERM or SIGUSR1 was passed
            on, before SIGKILL (torch's flag; default 30 or TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
        tolerate_ranks: global ranks (the same set on every node) whose own death (a signal,
            a non-zero exit other than the watchdog's 75 or SIGTERM's 143) is a warning, not a
            failure: the other workers run on. Scripts and modules only, not functions; the
            workers must be able to go on without them (async parameter-server workers).
        live: a worker killed by a signal, or left out by its peers, is started again in place
            while the others run on (`ringtrain.launch.live_agent`); the workers must recover
            without it (`ringtrain train --live`). A fixed number of nodes, no max_restarts.
        live_spares: with `live`, warm spares started beside the workers: a lost worker's
            place is taken by one at once (`ringtrain.launch.live_agent`).
        memory: the workers' memory cgroups, when `entrypoint` joins them (`--memory-limit`,
            `ringtrain.launch.cgroup`): each live spare gets one of its own beside them.
        cold_starts: start each worker as a fresh interpreter, not forked from the job's warm
            process (`ringtrain.launch.starts`).
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node}: start at least one worker per node")
    max_nodes = int(str(nnodes).split(":")[-1])
    if max_nodes > 1 and not rdzv_endpoint:
        raise ValueError(f"nnodes={nnodes!r} needs rdzv_endpoint='host:port' of node 0 "
                         "(the same on every node)")
    argv = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes),
            "--node-rank", str(node_rank), "--rdzv-backend", rdzv_backend,
            "--max-restarts", str(max_restarts), "--monitor-interval", str(monitor_interval)]
    if cold_starts:
        argv.append("--cold-starts")
    if rdzv_endpoint:
        argv += ["--rdzv-endpoint", rdzv_endpoint]
    if run_id:
        argv += ["--rdzv-id", run_id]
    if shutdown_timeout is not None:
        if not has_shutdown_timeout():
            raise ValueError(f"shutdown_timeout={shutdown_timeout}: needs torch 2.13 or newer "
                             f"(torch {torch.__version__}'s agent gives the workers a fixed 30 s "
                             "to exit after SIGTERM); leave it None or upgrade torch")
        argv += ["--shutdown-timeout", str(shutdown_timeout)]
    if callable(entrypoint):
        if tolerate_ranks:
            raise ValueError("tolerate_ranks applies to a script or module entrypoint, not a "
                             "function; launch the function's module with module=True")
        parsed = get_args_parser().parse_args([*argv, "<function>"])
        return _run(parsed, entrypoint, args)
    parsed = get_args_parser().parse_args([*argv, *(["-m"] if module else []), entrypoint, *args])
    if live and (max_restarts or not str(nnodes).isdigit()):
        raise ValueError(f"live=True with max_restarts={max_restarts}, nnodes={nnodes!r}: live "
                         "mode replaces workers in place on a fixed set of nodes; use "
                         f"max_restarts=0 and nnodes='{max_nodes}'")
    return _run(parsed, tolerate_ranks=tolerate_ranks, live=live, live_spares=live_spares,
                memory=memory)
