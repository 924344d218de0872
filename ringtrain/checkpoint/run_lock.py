"""One run per run directory: rank 0 holds RUN_DIR/.lock while it trains.

    fd = hold_run_dir("runs/a")   # RunDirInUse when another run holds it, naming that run
    ...                           # train
    release_run_dir(fd)           # or the process ends, however it ends: the kernel lets go
    holder("runs/a")              # "pid 4242 on node1, since ...": a run holds it now; or None

The same `ringtrain train --run-dir DIR` typed again while the first is still running (another
terminal, a batch job submitted twice) resumed the first one's newest snapshot and wrote into the
same metrics.jsonl at the same time: lines of both runs interleaved and cut, snapshots of two runs
side by side. The lock is `flock` on RUN_DIR/.lock, taken without waiting: a second run is one
message naming the first (its pid, host and start, which the holder writes into the file).

A flock belongs to the open file, so it goes with the process that holds it: a killed rank 0
never leaves a stale lock (a restarted job's new rank 0 takes it again), and no pid file is read
to guess whether its writer is alive. The file is never deleted (a delete while another process
opens it would let two hold two files). Across hosts the lock is the shared filesystem's (NFS
maps flock to its byte-range locks); where the filesystem has no locks the run goes on, with a
warning, unprotected as before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time

from ringtrain.errors import ConfigError

LOCK = ".lock"  # RUN_DIR/.lock

log = logging.getLogger("ringtrain")


class RunDirInUse(ConfigError):
    """Another run holds the run directory's lock; the message names it and the fixes."""


def hold_run_dir(run_dir: str) -> int | None:
    """Take `run_dir`'s lock for this process: its file descriptor (keep it open while the run
    lasts), None where the filesystem has no locks (warned), RunDirInUse where another holds it.
    """
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holders_words(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no locks here (ENOLCK, ...)
            log.warning("warning: %s cannot be locked (%s): nothing stops a second run in this "
                        "--run-dir from writing into it at the same time", run_dir, e.strerror)
            return None
        raise RunDirInUse(f"--run-dir {run_dir} is in use by another run ({holder}): two runs "
                          "in one directory would write each other's snapshots and metrics. "
                          "Wait for it to end (or stop it), or give another --run-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    return fd


def release_run_dir(fd: int | None) -> None:
    """Let the lock go (closing the file releases it); None: nothing was held."""
    if fd is not None:
        os.close(fd)


def holder(run_dir: str) -> str | None:
    """Who holds `run_dir`'s lock now, in its own words (pid, host, start), or None: no run
    holds it, or the filesystem has no locks (`ringtrain explain`: still running, or not)."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:  # shared and let go at once: a reader, never in a starting run's way for longer
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return _holders_words(fd)
        return None
    finally:
        os.close(fd)
    return None


def _holders_words(fd: int) -> str:
    """What the holder wrote into the lock file (its pid, host and start)."""
    return os.read(fd, 512).decode(errors="replace").strip() or "another process"
