"""The failure report of `ringtrain run`: one block instead of torch's multi-page error dump.

    ringtrain run --nproc-per-node 2 train.py      # a worker fails: the launcher prints the report

It says which rank failed first (`root_cause`: a rank that only lost its peer is a symptom), its
exit code or signal, and its traceback, written by workers whose main is decorated with
`ringtrain.launch.launcher.record`; then, one line each, what became of the other ranks. When every
failed rank exited with 2 (`explained_by_workers`), the workers have explained a user mistake
themselves (`ringtrain train` prints it once, on rank 0): the launcher prints no report.
"""

from __future__ import annotations

import signal
import socket

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ringtrain.errors import USAGE_EXIT_CODE, is_connection_lost
from ringtrain.launch.peer_failure import PEER_FAILED_EXIT_CODE

# `ringtrain train` workers exit with 128 + SIGTERM after saving a snapshot on SIGTERM or SIGINT.
STOPPED_EXIT_CODE = 128 + signal.SIGTERM
_PEER_FAILURE = "PeerFailure: "  # how a watchdog's error file starts (ringtrain.launch.watchdog)
# Lines torch's agent logs that the failure report below says once, better.
_REPEATED_BY_REPORT = (
    "closing signal",  # one line per surviving worker
    "failed (exitcode",  # the root cause, again
    "death signal, shutting down workers",
    "Setting OMP_NUM_THREADS",  # a boxed notice on every launch
    "Terminating process",  # function entrypoints: one line per surviving worker
)


def _describe_exit(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    if failure.exitcode == PEER_FAILED_EXIT_CODE:
        return f"exit code {failure.exitcode} (stopped by its watchdog: a peer failed)"
    if failure.exitcode == STOPPED_EXIT_CODE:
        return f"exit code {failure.exitcode} (stopped on a signal; a snapshot resumes the run)"
    return f"exit code {failure.exitcode}"


def _error_text(failure: ProcessFailure) -> tuple[str, str]:
    """(one-line message, traceback) from the worker's error file; empty when it wrote none."""
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(message.get("message", "")), str(extra.get("py_callstack", "")).strip()
    return "", ""  # torch's made-up text ("Signal 9 received by PID ...") says nothing new


def explained_by_workers(failures: dict[int, ProcessFailure]) -> bool:
    """True when the workers have already explained why they stopped: every failed rank exited
    with `USAGE_EXIT_CODE` (2) and wrote no error file, or was stopped by the launcher after."""
    usage = [f for f in failures.values() if f.exitcode == USAGE_EXIT_CODE]
    others = [f for f in failures.values() if f.exitcode != USAGE_EXIT_CODE]
    return (bool(usage) and not any(_error_text(f)[0] for f in usage)
            and all(f.exitcode == -signal.SIGTERM for f in others))


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


def _what_became_of(failure: ProcessFailure, first_message: str) -> str:
    """One other rank's end: what it raised itself (its error file; often the first rank's own
    error, every rank having made the same mistake), else how it exited."""
    message = _error_text(failure)[0]
    if message and not message.startswith(_PEER_FAILURE) and not _is_symptom(failure):
        return "the same error" if message == first_message else message
    return "stopped by the launcher" if failure.exitcode == -signal.SIGTERM else \
        _describe_exit(failure)


def root_message(failures: dict[int, ProcessFailure]) -> str:
    """What the first failing rank raised, or how it exited: one attempt's failure in a line."""
    failure = failures[root_cause(failures)]
    return _error_text(failure)[0] or _describe_exit(failure)


def same_every_attempt(earlier: list[str], last: str) -> str | None:
    """A line for the end of a job whose every attempt failed with the same exception (a bug:
    restarting cannot help), or None. `earlier`: `root_message` of each restarted attempt."""
    if not earlier or any(m != last for m in earlier) or not last or last.startswith(
            ("killed by", "exit code", _PEER_FAILURE)):
        return None  # a kill, an exit code, a lost peer: a restart may well have helped
    return (f"ringtrain run: every attempt ({len(earlier) + 1}) failed with this same error: "
            "restarts help a worker or node that was lost, not a mistake in the script; fix it, "
            "then run again")


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
        lines = [f"ringtrain run: rank {rank} failed ({where}): "
                 f"{message or _describe_exit(failure)}"]

    if callstack and callstack != message and not message.startswith(_PEER_FAILURE):
        lines += ["  " + line for line in callstack.splitlines()]
    elif not message and failure.exitcode > 0 and failure.exitcode != STOPPED_EXIT_CODE:
        lines.append("  (its traceback, if any, is in its output above; decorate the script's "
                     "main with @ringtrain.launch.launcher.record to have it here)")
    others: dict[str, list[int]] = {}
    for r, f in err.failures.items():
        if r != rank:
            others.setdefault(_what_became_of(f, message), []).append(r)
    for why, ranks in others.items():
        listed = ", ".join(map(str, sorted(ranks)))
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {listed}: {why}")
    return "\n".join(lines)
