"""`ringtrain run`: torchrun's flags on torch's own elastic agent, with one readable failure report.

    ringtrain run --nproc-per-node 2 train.py --lr 3e-4
    ringtrain run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 train.py   # on each node
    ringtrain run --help

Parsing, rendezvous, worker start-up, monitoring and teardown are torch's
(`torch.distributed.run` / `elastic_launch`); this file only
- picks a free port by itself on a single node (two jobs at once never collide),
- polls the workers every 0.1 s, so a dead worker stops the rest promptly,
- replaces torch's multi-page error dump by one block: which rank failed first, its exit code
  or signal, and its traceback (written by workers whose main is decorated with `record`),
- keeps workers from outliving a SIGKILLed launcher (`die_with_parent`, called in the worker),
- lets chosen ranks die without stopping the others (`launch(..., tolerate_ranks=...)`, used by
  `ringtrain train --strategy ps --ps-mode async` for its workers other than rank 0).

    from ringtrain.launcher import record
    @record                          # the launcher then prints this worker's traceback
    def main(): ...
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Collection, Iterator

import torch.distributed.launcher.api as _launcher_api
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    record,
)
from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args
from torch.distributed.run import get_args_parser as _torch_args_parser

from ringtrain.runtime import network_interfaces, route_source
from ringtrain.watchdog import PEER_FAILED_EXIT_CODE, is_connection_lost

__all__ = ["ChildFailedError", "die_with_parent", "format_failure", "get_args_parser", "launch",
           "main", "record", "root_cause"]

LAUNCHER_PID_ENV = "RINGTRAIN_LAUNCHER_PID"  # lets a worker check its parent is still there
# `ringtrain train` workers exit with 128 + SIGTERM after saving a snapshot on SIGTERM.
STOPPED_EXIT_CODE = 128 + signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_PEER_FAILURE = "PeerFailure: "  # how a watchdog's error file starts (ringtrain.watchdog)
# Across nodes, the agent gives up on a rendezvous store silent this long (the watchdog's
# default timeout: the workers notice the same loss about as fast), and waits this long
# to close the rendezvous on its way out.
RENDEZVOUS_SILENT_S, RENDEZVOUS_CLOSE_S = 30.0, 3.0
# Lines torch's agent logs that the failure report below says once, better.
_REPEATED_BY_REPORT = (
    "closing signal",  # one line per surviving worker
    "failed (exitcode",  # the root cause, again
    "death signal, shutting down workers",
    "Setting OMP_NUM_THREADS",  # a boxed notice on every launch
    "Terminating process",  # function entrypoints: one line per surviving worker
)


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Have the kernel send `signum` to this process when its parent (the launcher) dies.

    Call it first thing in a worker: a SIGKILLed launcher runs no cleanup, and without this
    its workers would keep running (and holding GPUs) as orphans. Linux only; no-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    # The launcher may have died between our fork and the prctl call: then nobody will signal us.
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        os.kill(os.getpid(), signum)


def get_args_parser():
    """torchrun's argument parser (every flag, `-` and `_` spellings), named `ringtrain run`."""
    parser = _torch_args_parser()
    parser.prog = "ringtrain run"
    parser.set_defaults(monitor_interval=0.1)  # notice a dead worker fast (older torch: 5 s)
    parser.description = (
        "Launch a script on N processes per node with torch's elastic agent (torchrun's flags). "
        "On a single node a free port is picked automatically. When a worker fails, all "
        "workers stop and the failing rank is reported once."
    )
    return parser


class _Curate(logging.Filter):
    """Keep torch's warnings and errors except those the report repeats; keep restart notices."""

    def filter(self, entry: logging.LogRecord) -> bool:
        msg = str(entry.msg)
        if "attempts left" in msg:  # logged at INFO, but a restart is news to the user
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


def _single_node_rendezvous(args) -> None:
    """What `--standalone` does, also for a plain `--nnodes 1` without an endpoint.

    c10d rendezvous at localhost:0: the agent's TCPStore binds port 0 and the OS hands it a
    free port, so there is no window in which another job can take it.
    """
    try:
        max_nodes = int(str(args.nnodes).split(":")[-1])
    except ValueError:
        raise ValueError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX, e.g. --nnodes 2") from None
    if args.standalone or (max_nodes == 1 and not args.rdzv_endpoint and args.master_port is None
                           and args.rdzv_backend in ("static", "c10d")):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500  # only read by the static backend, as in torchrun


def _multi_node_addresses(args) -> None:
    """Across nodes: advertise the address that reaches the rendezvous host, not the hostname's.

    torch's agent advertises `socket.getfqdn()` as MASTER_ADDR and decides whether it hosts the
    c10d store by resolving its hostname; where the hostname resolves to 127.0.0.1 (common on
    cloud images and containers) the other nodes get an unreachable MASTER_ADDR and node 0 does
    not host the store it was named for. So when --nnodes > 1: `--local-addr` defaults to this
    node's IPv4 address on the interface that routes to the --rdzv-endpoint host, and the node
    whose own address is the endpoint hosts the c10d store (`is_host`, unless --rdzv-conf says).
    """
    max_nodes = int(str(args.nnodes).split(":")[-1])
    if max_nodes == 1 or not args.rdzv_endpoint:
        return
    host = args.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        return  # unresolvable: torch's rendezvous says so with the endpoint in the message
    local = route_source(host_ip)
    if local is None:
        return
    interfaces = network_interfaces()
    if args.local_addr is None:
        args.local_addr = local
        names = [n for n, a in interfaces.items() if a == local]
        print(f"ringtrain run: node {args.node_rank}: local address {local} (interface "
              f"{names[0] if names else '?'}), the route to the rendezvous endpoint "
              f"{args.rdzv_endpoint}; --local-addr overrides it", file=sys.stderr, flush=True)
    conf = args.rdzv_conf or ""
    if (args.rdzv_backend == "c10d" and "is_host=" not in conf
            and host_ip in interfaces.values() and not _matches_machine_hostname(host)):
        args.rdzv_conf = ",".join(filter(None, [conf, "is_host=true"]))


def _call_into(fn: Callable, out: list) -> None:
    try:
        out.append((fn(), None))
    except Exception as e:  # handed to the caller's thread
        out.append((None, e))


class _BoundedRendezvous:
    """torch's rendezvous handler, but the agent never blocks on a vanished store host.

    While its workers run, torch's agent asks the rendezvous store every monitor interval
    whether nodes wait to join (`num_nodes_waiting`), and it closes the rendezvous on its way
    out (`shutdown`). When the store's host vanishes without closing its sockets (power or
    network loss), each such call blocks for minutes (the TCPStore client waits, then retries),
    so the launcher would hang long after its workers' watchdogs stopped them. Here the query
    runs on a helper thread: while one is pending the agent gets the last answer and goes on
    watching its workers; one pending for `silent_s` raises; `shutdown` gives up after `close_s`.
    """

    def __init__(self, inner, endpoint: str, silent_s: float, close_s: float):
        self._inner, self._endpoint = inner, endpoint
        self._silent_s, self._close_s = silent_s, close_s
        self._waiting = 0
        self._pending: tuple[threading.Thread, float, list] | None = None

    def num_nodes_waiting(self) -> int:
        if self._pending is None:
            out: list = []
            thread = threading.Thread(target=_call_into, args=(self._inner.num_nodes_waiting, out),
                                      name="ringtrain-rdzv-query", daemon=True)
            thread.start()
            self._pending = (thread, time.monotonic(), out)
        thread, started, out = self._pending
        thread.join(timeout=1.0)  # a live store answers in milliseconds
        if thread.is_alive():
            if time.monotonic() - started > self._silent_s:
                raise RendezvousConnectionError(
                    f"the rendezvous store at {self._endpoint} did not answer for "
                    f"{self._silent_s:g} s")
            return self._waiting
        self._pending = None
        value, error = out[0]
        if error is not None:
            raise error
        self._waiting = value
        return value

    def shutdown(self) -> bool:
        out: list = []
        thread = threading.Thread(target=_call_into, args=(self._inner.shutdown, out), daemon=True)
        thread.start()
        thread.join(timeout=self._close_s)
        return bool(out and out[0][0])

    def __getattr__(self, name: str):  # the rest as torch's (joins: torch bounds them)
        return getattr(self._inner, name)


@contextlib.contextmanager
def _bounded_rendezvous(endpoint: str) -> Iterator[None]:
    """Have `elastic_launch` (only it) wrap its rendezvous handler in `_BoundedRendezvous`."""
    registry = _launcher_api.rdzv_registry
    _launcher_api.rdzv_registry = types.SimpleNamespace(
        get_rendezvous_handler=lambda params: _BoundedRendezvous(
            registry.get_rendezvous_handler(params), endpoint, RENDEZVOUS_SILENT_S, RENDEZVOUS_CLOSE_S))
    try:
        yield
    finally:
        _launcher_api.rdzv_registry = registry


def _tolerated_exit(exitcode: int) -> bool:
    """Whether a tolerated rank's exit code is its own death (not a stop the job asked for).

    Exits that say "a peer failed" (the watchdog's) or "stopped on SIGTERM" (a snapshot was
    saved, or the agent is tearing down) belong to the whole job: they are never tolerated.
    """
    return exitcode not in (0, PEER_FAILED_EXIT_CODE, STOPPED_EXIT_CODE, -signal.SIGTERM)


@contextlib.contextmanager
def _tolerating(ranks: Collection[int]) -> Iterator[None]:
    """Inside: a tolerated global rank's own death is a warning, not a failure of the job.

    torch's agent polls `SubprocessContext._poll`, which records every non-zero exit as a
    failure and then stops every worker. Here the recording step is wrapped: a tolerated
    rank that died is logged and taken off the running ranks as if it had finished, so the
    others run on and the job succeeds if they do. Relies on torch internals (the context's
    `_running_local_ranks`, `subprocess_handlers`, `envs` with RANK), checked at torch 2.13.0;
    functions launched in-process (`launch(fn)`) use another context and are not covered.
    """
    if not ranks:
        yield
        return
    original = SubprocessContext._capture_process_failures
    tolerated = frozenset(ranks)

    def capture(self, done_local_ranks: set[int]) -> None:
        for local_rank in sorted(self._running_local_ranks):
            proc = self.subprocess_handlers[local_rank].proc
            rank = int(self.envs[local_rank].get("RANK", -1))
            exitcode = proc.poll()
            if rank in tolerated and exitcode is not None and _tolerated_exit(exitcode):
                self._running_local_ranks.discard(local_rank)  # torch's step never sees it
                done_local_ranks.add(local_rank)
                how = (f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0
                       else f"exit code {exitcode}")
                print(f"ringtrain run: warning: rank {rank} (local_rank {local_rank}, pid "
                      f"{proc.pid}) died ({how}); it is a tolerated rank, the others go on",
                      file=sys.stderr, flush=True)
        original(self, done_local_ranks)

    SubprocessContext._capture_process_failures = capture
    try:
        yield
    finally:
        SubprocessContext._capture_process_failures = original


def _describe_exit(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    if failure.exitcode == PEER_FAILED_EXIT_CODE:
        return f"exit code {failure.exitcode} (stopped by its watchdog: a peer failed)"
    if failure.exitcode == STOPPED_EXIT_CODE:
        return f"exit code {failure.exitcode} (stopped on SIGTERM; a snapshot resumes the run)"
    return f"exit code {failure.exitcode}"


def _error_text(failure: ProcessFailure) -> tuple[str, str]:
    """(one-line message, traceback) from the worker's error file; empty when it wrote none."""
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(message.get("message", "")), str(extra.get("py_callstack", "")).strip()
    return "", ""  # torch's made-up text ("Signal 9 received by PID ...") says nothing new


def _is_symptom(failure: ProcessFailure) -> bool:
    """A rank that stopped because another failed: its watchdog said so, or a lost connection."""
    return failure.exitcode == PEER_FAILED_EXIT_CODE or is_connection_lost(_error_text(failure)[0])


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The global rank that failed first, as far as the agent can tell.

    torch keeps failures in the order it observed them and stamps them to the second; a rank
    that only lost its peer (watchdog exit, lost-connection error) is a symptom, and a SIGTERM
    is usually the agent's own teardown, so both rank behind any other failure.
    """
    order = list(failures)
    return min(order, key=lambda r: (
        _is_symptom(failures[r]),
        failures[r].exitcode == -signal.SIGTERM,
        failures[r].timestamp,
        order.index(r),
    ))


def format_failure(err: ChildFailedError) -> str:
    """The report: the first failing rank, why, its traceback, and what became of the others."""
    rank = root_cause(err.failures)
    failure = err.failures[rank]
    message, callstack = _error_text(failure)
    where = f"local_rank {failure.local_rank}, host {socket.gethostname()}, pid {failure.pid}"
    if message.startswith(_PEER_FAILURE):
        # Every rank here only stopped for a peer: the root cause ran on another node. Lead with it.
        lines = [f"ringtrain run: {message[len(_PEER_FAILURE):]}; rank {rank} ({where}) stopped"]
    else:  # what it raised says more than the exit code (or the SIGTERM that cut its exit short)
        lines = [f"ringtrain run: rank {rank} failed ({where}): {message or _describe_exit(failure)}"]
    if callstack and callstack != message and not message.startswith(_PEER_FAILURE):
        lines += ["  " + line for line in callstack.splitlines()]
    elif not message and failure.exitcode > 0 and failure.exitcode != STOPPED_EXIT_CODE:
        lines.append("  (its traceback, if any, is in its output above; decorate the script's "
                     "main with @ringtrain.launcher.record to have it here)")
    others: dict[str, list[int]] = {}
    for r, f in err.failures.items():
        if r != rank:
            why = "stopped by the launcher" if f.exitcode == -signal.SIGTERM else _describe_exit(f)
            others.setdefault(why, []).append(r)
    for why, ranks in others.items():
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {why}")
    return "\n".join(lines)


def _run(args, entrypoint: Callable | str | None = None, entry_args: list | None = None,
         tolerate_ranks: Collection[int] = ()) -> int:
    """Launch from parsed torchrun arguments; the entrypoint may be replaced by a function.

    `tolerate_ranks`: global ranks whose own death does not stop the others (`_tolerating`).
    """
    script = args.training_script
    if entrypoint is None and not args.module and not args.no_python and not os.path.isfile(script):
        print(f"ringtrain run: error: training script {script!r} not found (in {os.getcwd()}); "
              "pass a path to a .py file, or -m for a module", file=sys.stderr)
        return 2
    try:
        _single_node_rendezvous(args)
        _multi_node_addresses(args)
        with _quiet_torch_logs():
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
                                                 signal.SIGQUIT)}
    multi_node = int(str(args.nnodes).split(":")[-1]) > 1
    try:
        with _quiet_torch_logs(), _tolerating(tolerate_ranks), (
                _bounded_rendezvous(config.rdzv_endpoint) if multi_node else contextlib.nullcontext()):
            elastic_launch(config, cmd)(*cmd_args)
        return 0
    except ChildFailedError as e:
        print(format_failure(e), file=sys.stderr, flush=True)
        # The workers stopped on SIGTERM after saving (a slow one may have been stopped by the
        # agent itself): say so with the same code, not 1.
        codes = {f.exitcode for f in e.failures.values()}
        if STOPPED_EXIT_CODE in codes and codes <= {STOPPED_EXIT_CODE, -signal.SIGTERM}:
            return STOPPED_EXIT_CODE
        return 1
    except SignalException as e:  # the agent already stopped the workers with the same signal
        name = signal.Signals(e.sigval).name
        print(f"ringtrain run: got {name}; stopped all workers", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except RendezvousConnectionError as e:
        cause = e.__cause__ or e
        print(f"ringtrain run: cannot reach the rendezvous store at {config.rdzv_endpoint} "
              "(--rdzv-endpoint): its node died, is unreachable or has not started; stopped the "
              f"workers here ({str(cause).splitlines()[0] if str(cause) else type(cause).__name__})",
              file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # rendezvous timeouts and the like: one line, not a stack
        print(f"ringtrain run: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if share_store is None:
            os.environ.pop(_SHARE_STORE_ENV, None)
        for s, h in handlers.items():  # the agent replaced them; `launch` may be called again
            if h is not None:
                with contextlib.suppress(ValueError):  # not on the main thread
                    signal.signal(s, h)


def main(argv: list[str]) -> int:
    """`ringtrain run ARGS`; returns the exit code.

    0 when every worker succeeded, 1 when one failed (reported on stderr), 2 for bad flags,
    128 + N when the launcher got signal N (the workers are stopped first), 143 when every
    worker exited with 143 (`ringtrain train` workers do after saving a snapshot on SIGTERM).
    """
    parser = get_args_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    return _run(args)


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
) -> int:
    """Run `entrypoint` on `nproc_per_node` workers here (and join `nnodes` nodes); return the exit code.

    Args:
        entrypoint: a script path (run as `python -u script *args`), a module name with
            `module=True` (`python -u -m module *args`, e.g. "ringtrain" with ["train", ...]),
            or a picklable module-level function called as `fn(*args)` in each worker.
        args: the entrypoint's arguments.
        nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_backend, max_restarts,
            monitor_interval, run_id: torchrun's flags of the same names. A single node without
            `rdzv_endpoint` picks a free port; several nodes need `rdzv_endpoint` (host:port
            of node 0) and the same `run_id` on every node.
        tolerate_ranks: global ranks (the same set on every node) whose own death (a signal,
            a non-zero exit other than the watchdog's 75 or SIGTERM's 143) is a warning, not a
            failure: the other workers run on. Scripts and modules only, not functions; the
            workers must be able to go on without them (async parameter-server workers).
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
    if rdzv_endpoint:
        argv += ["--rdzv-endpoint", rdzv_endpoint]
    if run_id:
        argv += ["--rdzv-id", run_id]
    if callable(entrypoint):
        if tolerate_ranks:
            raise ValueError("tolerate_ranks applies to a script or module entrypoint, not a "
                             "function; launch the function's module with module=True")
        parsed = get_args_parser().parse_args([*argv, "<function>"])
        return _run(parsed, entrypoint, args)
    parsed = get_args_parser().parse_args([*argv, *(["-m"] if module else []), entrypoint, *args])
    return _run(parsed, tolerate_ranks=tolerate_ranks)
