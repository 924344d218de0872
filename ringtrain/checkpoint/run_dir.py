"""The run directory: checked before a run starts, and the words for a disk that fills up.

    ringtrain train --run-dir /proc/forbidden   # one line naming the directory and the fix, exit 2

    python -c "from ringtrain.checkpoint.run_dir import describe_space; print(describe_space('.'))"

`ringtrain train` calls `check_run_dir` in `main()`, before any worker starts, so a directory
that cannot be used (not a directory, not writable, full) is one message and exit code 2, not a
traceback per worker. A disk that fills up *during* a run stops it at its last committed
snapshot with `DiskFullError` (`ringtrain.checkpoint.resume.Checkpointer`), which
`ringtrain train` turns into one message and `DISK_FULL_EXIT_CODE`. Tests:
`.venv/bin/pytest -q tests/test_disk.py`.

"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from ringtrain.errors import DISK_FULL_EXIT_CODE

__all__ = ["DISK_FULL_EXIT_CODE", "MIN_FREE_BYTES", "DiskFullError", "RunDirError",
           "check_run_dir", "describe_space", "disk_space", "is_no_space", "no_space_message"]

# Below this a run cannot even write config.json, a few metrics lines and summary.json.
MIN_FREE_BYTES = 1_000_000
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RunDirError(ValueError):
    """A run directory that cannot be used: not a directory, not writable, or full."""


class DiskFullError(RuntimeError):
    """The run directory filled up during a run; the message names it, its free space and the
    fix."""


def is_no_space(exc: BaseException) -> bool:
    """True when `exc`, or an error it was raised from or while handling, is a full disk or
    quota."""

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def unless_full(write, path: str, *args: Any) -> None:
    """`write(path, *args)` for a file that only informs (config.json): on a full disk, one
    warning and the run goes on. A restarted worker meets the disk a user has not freed yet
    here first; its next snapshot then stops every rank with the one message (exit 74)."""
    try:
        write(path, *args)
    except OSError as e:
        if not is_no_space(e):
            raise
        logging.getLogger("ringtrain").warning("warning: %s not written: %s (%s)", path,
                                               e.strerror, describe_space(os.path.dirname(path)))


def disk_space(path: str | os.PathLike) -> tuple[int, int]:
    """(free, total) bytes of the filesystem that holds `path`, or would once it is created."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    return usage.free, usage.total


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def describe_space(path: str | os.PathLike) -> str:
    """'0.4 MB free of 3.1 MB' for the filesystem of `path` (MB = 10**6 bytes, as in the logs)."""
    try:
        free, total = disk_space(path)
    except OSError as e:  # the message this goes into matters more than the figure
        return f"free space unknown: {e.strerror}"
    return f"{_mb(free)} free of {_mb(total)}"


def no_space_message(directory: str | os.PathLike, what: str, snapshot_step: int | None,
                     need_bytes: int | None = None) -> str:
    """The one message of a run stopped by a full disk: where, how full, what survives, the fix."""
    need = f"; a snapshot needs about {_mb(need_bytes)}" if need_bytes else ""
    last = (f"the last committed snapshot is step {snapshot_step}" if snapshot_step is not None
            else "no snapshot was committed, so the next run starts from step 0")
    return (f"no space left on device writing {what} in {directory} ({describe_space(directory)}"
            f"{need}); {last}; free space there or choose --run-dir elsewhere (move the run "
            "directory there to keep its snapshots), then run the same command again to resume")


def check_run_dir(path: str | os.PathLike, min_free_bytes: int = MIN_FREE_BYTES) -> list[Path]:
    """Create `path` if needed and check a run can write there; raise `RunDirError` saying why not.

    Checks, in order: every existing part of the path is a directory; the directory can be
    created; a file can be written and synced in it (a read-only mount, no permission, a full
    disk); enough is free: `min_free_bytes`, or the size of its newest snapshot if larger (the
    next one is as big). Before the last check it removes the temp folders of snapshot saves
    that never finished (`path/snapshots/.tmp-snap-*`: a crash, a full disk), and returns them.
    Call it before any worker starts: a save in progress writes into such a folder.
    """
    # Here, not at the top: checkpoint_io imports torch, and this module is imported early.
    from ringtrain.checkpoint.files import newest_snapshot_bytes, remove_unfinished

    p = Path(path)
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "it is" if existing == p else f"{existing} is"
        raise RunDirError(f"--run-dir {path}: {where} a file, not a directory; choose another "
                          "--run-dir (or move the file away)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if is_no_space(e):
            raise RunDirError(_full(path, existing, min_free_bytes, 0)) from None
        raise RunDirError(f"--run-dir {path}: cannot create it in {existing} ({e.strerror}); "
                          "choose a directory you can write to, e.g. --run-dir runs/mine") from None
    probe = p / f".ringtrain-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"ringtrain")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if not is_no_space(e):
            raise RunDirError(f"--run-dir {path}: cannot write in it ({e.strerror}); choose a "
                              "directory you can write to, e.g. --run-dir runs/mine") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass  # never made, or a read-only directory: nothing to clean
    removed = remove_unfinished(p / "snapshots")
    snapshot = newest_snapshot_bytes(p / "snapshots") or 0
    free, _ = disk_space(p)
    if free < max(min_free_bytes, snapshot):
        raise RunDirError(_full(path, p, min_free_bytes, snapshot))
    return removed


def _full(path: str | os.PathLike, where: Path, min_free_bytes: int, snapshot: int) -> str:
    need = (f"its next snapshot needs about {_mb(snapshot)}" if snapshot > min_free_bytes
            else f"a run needs at least {_mb(min_free_bytes)}")
    keep = " (move the run directory there to keep its snapshots)" if snapshot else ""
    return (f"no space left on device for --run-dir {path} ({describe_space(where)}; {need}); "
            f"free space there or choose --run-dir elsewhere{keep}")
