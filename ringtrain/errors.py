"""User mistakes, told apart from bugs: `ConfigError` and the exit codes that say what happened.

    raise ConfigError("--pp 3 does not divide world_size=2; use --pp in [1, 2]")

A `ConfigError` is a mistake in the options or the inputs that only shows once the job runs
(a snapshot written with other options, a layout that needs the world size). Every rank finds
the same one, so `ringtrain train` prints its message once (rank 0), with no traceback, and
every worker exits with `USAGE_EXIT_CODE`; the launcher then adds nothing
(`ringtrain.launch.failure_report.explained_by_workers`). Any other exception is reported as a
failure, traceback and all. It subclasses ValueError, so code that catches ValueError still does.

"""

from __future__ import annotations

import torch.distributed as dist

USAGE_EXIT_CODE = 2  # argparse's: a usage error, already explained to the user
# "Requeue me": stopped on the scheduler's request (SIGTERM: preemption, scancel, a pod being
# evicted; SIGUSR1: Slurm's `--signal=USR1@SECONDS` before the time limit) after every rank saved
# the same step; the same command resumes. 128 + SIGTERM, which Kubernetes' `restartPolicy:
# ExitCode` (128..255) retries, and which a Slurm batch script or `RequeueExit=143` can requeue.
REQUEUE_EXIT_CODE = 143
# sysexits' EX_IOERR ("an error occurred while doing I/O on some file"): the run stopped because
# its directory is full; unlike 1 (a bug, a crash) it says "make room, then run it again".
DISK_FULL_EXIT_CODE = 74

# What gloo, NCCL and the store say when the peer at the other end is gone.
_CONNECTION_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "gloo/transport",
    "NCCL communicator was aborted",
    "NCCL error",
)


class ConfigError(ValueError):
    """A mistake the user fixes by changing the command line or the files it names."""


def is_connection_lost(exc: BaseException | str) -> bool:
    """True when `exc` (or an error message) says a collective or the store lost its peer.

    Such an error is a symptom of another rank's failure, not a cause.
    """
    if isinstance(exc, BaseException):
        if isinstance(exc, getattr(dist, "DistNetworkError", ())):
            return True
        if not isinstance(exc, RuntimeError):
            return False
    return any(s in str(exc) for s in _CONNECTION_LOST)
