"""The store handshake of one snapshot save: how the ranks agree, each wait bounded.

`SnapshotManager.save` (`snapshot.py`) runs the save; this module holds how its ranks talk
through the process group's key-value store: rank 0 publishes the temp directory's name and,
at the end, the outcome; the other ranks publish their part's files (or their error). Every
wait has a deadline, and a failure travels as a report that every rank raises as the same
kind of error (`SnapshotNoSpaceError` when a disk was full). Kept apart from the manager
because it knows nothing of files and directories, only keys, deadlines and reports.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from ringtrain.checkpoint.files import SnapshotError, SnapshotNoSpaceError
from ringtrain.checkpoint.run_dir import is_no_space

_POLL_S = 0.01


def save_error(message: str, cause: BaseException | None = None) -> SnapshotError:
    """The error of a failed save: `SnapshotNoSpaceError` when `cause` is a full disk."""
    return (SnapshotNoSpaceError if cause is not None and is_no_space(cause)
            else SnapshotError)(message)



def failure_report(error: SnapshotError) -> dict[str, Any]:
    """A failure as published in the store, so other ranks raise the same kind."""
    return {"error": str(error), "no_space": isinstance(error, SnapshotNoSpaceError)}


def reported_error(report: dict[str, Any], message: str) -> SnapshotError:
    return (SnapshotNoSpaceError if report.get("no_space") else SnapshotError)(message)


def publish(store: dist.Store | None, key: str, value: dict[str, Any]) -> None:
    if store is not None:
        store.set(key, json.dumps(value))


def wait_one(store: dist.Store, key: str, deadline: float, what: str, *, rank: int,
             timeout_s: float) -> dict[str, Any]:
    """Wait (until `deadline`) for rank 0's word on `key`; raise what it reports as failed."""
    start = time.monotonic()
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise SnapshotError(
                f"rank {rank}: rank 0 did not {what} within {time.monotonic() - start:.1f} s "
                f"(timeout_s={timeout_s:g}); snapshot not committed"
            )
        time.sleep(_POLL_S)
    value = json.loads(store.get(key))
    if "error" in value:
        raise reported_error(value, f"rank {rank}: snapshot not committed: {value['error']}")
    return value


def gather_parts(store: dist.Store, prefix: str, deadline: float, step: int, *, world_size: int,
                 timeout_s: float) -> tuple[list[dict[str, Any]], list[SnapshotError]]:
    """Rank 0: every other rank's files, and the errors of the ranks that failed or are late.

    A failed rank reports at once, so the others' reports are still waited for (until the
    deadline): the outcome then says whether any disk was full.
    """
    pending, parts, errors = set(range(1, world_size)), [], []
    while pending:
        for r in sorted(pending):
            if store.check([f"{prefix}/{r}"]):
                report = json.loads(store.get(f"{prefix}/{r}"))
                if "error" in report:
                    errors.append(reported_error(report, report["error"]))
                else:
                    parts.append(report["files"])
                pending.discard(r)
        if pending and time.monotonic() > deadline:
            errors.append(SnapshotError(
                f"ranks {sorted(pending)} did not finish their part of snapshot step {step} "
                f"within timeout_s={timeout_s:g}: late to call save(), or not calling it "
                "(every rank calls save() at the same step, not rank 0 alone), or a slow disk; "
                "snapshot not committed"))
            break
        if pending:
            time.sleep(_POLL_S)
    return parts, errors
