"""Rank 0's directory work after a save's parts are in: commit, then rotation.

`commit` turns the temp directory into `snap-{step:08d}`: manifest, fsync, rename, the `COMMITTED`
marker last (a snapshot of the same step saved again replaces the old one, which is put back if the
commit fails). `retain` keeps the newest `keep` committed snapshots and removes the debris of
crashed and replaced saves. `newer_than` refuses, before a save, a step below an intact committed
one (it would never be resumed). Kept apart from `snapshot.py` because this is one process renaming
directories, no ranks and no store; the layout it writes is described in `snapshot.py`'s docstring,
the files in `files.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ringtrain.checkpoint.files import (
    COMMITTED,
    MANIFEST,
    SnapshotError,
    fsync_dir,
    read_manifest,
    snap_dirs,
    snap_step,
    verify,
    write_durably,
)


def commit(root: Path, tmp: Path, step: int, files: dict[str, Any], meta: dict[str, Any], *,
           world_size: int) -> Path:
    """Rank 0: manifest, fsync, rename, then the COMMITTED marker last."""
    manifest = {"format": 1, "step": step, "world_size": world_size,
                "created_unix": time.time(), "files": files, "metadata": meta}
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_durably(tmp / MANIFEST, raw)
    fsync_dir(tmp)
    final, old = root / f"snap-{step:08d}", None
    if final.exists():  # the same step saved again after a restart: the new one replaces it
        old = root / f".old-snap-{step:08d}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    try:
        tmp.rename(final)
        marker = {"step": step, "manifest_sha256": hashlib.sha256(raw).hexdigest()}
        write_durably(final / f".{COMMITTED}.tmp", json.dumps(marker).encode())
        (final / f".{COMMITTED}.tmp").rename(final / COMMITTED)
    except BaseException:
        # Not committed (e.g. no room for the marker): put back the snapshot it replaced.
        if not tmp.exists():  # renamed: `final` is this save's, without its marker
            shutil.rmtree(final, ignore_errors=True)
        if old is not None:
            old.rename(final)
        raise
    fsync_dir(final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def retain(root: Path, keep: int, just: Path | None = None) -> None:
    """Rank 0, after a commit: keep the newest `keep` committed snapshots, drop the debris.

    `just` (the snapshot this save committed) is always kept: committed snapshots of later
    steps, which `newer_than` let through only because they are corrupt, go first.
    """
    dirs = snap_dirs(root)
    committed = [p for p in dirs if (p / COMMITTED).is_file()]
    if just is not None:
        later = [p for p in committed if snap_step(p) > snap_step(just)]
        committed = [just, *[p for p in committed if p != just and p not in later], *later]
    stale = committed[keep:] + [p for p in dirs if p not in committed]
    stale += [p for p in root.glob(".*-snap-*") if p.is_dir()]  # temp and replaced dirs
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)


def newer_than(root: Path, step: int) -> str | None:
    """Before a save of `step` (every rank): why it must not be written where a committed,
    intact snapshot of a later step exists, or None.

    `latest()`, so every resume, takes the newest step: a save of an earlier one would never be
    resumed (and `retain` with keep=1 removed it at once, though its save said committed). A run
    that went back to an earlier snapshot on purpose removes the later ones first. A later one
    that is corrupt (a resume already skipped it) does not count: the trainer saves past it.
    Only when a later directory exists is anything hashed.
    """
    later = []
    for p in snap_dirs(root):
        if snap_step(p) <= step:
            break
        try:
            if (p / COMMITTED).is_file():
                verify(p, read_manifest(p))
                later.append(p)
        except SnapshotError:
            continue
    if not later:
        return None
    return (f"step={step}: {root} holds a committed snapshot of a later step ({later[0].name}"
            f"{f' and {len(later) - 1} more' if len(later) > 1 else ''}), which latest(), so "
            "every resume, would take instead of this one. To continue from an earlier step on "
            "purpose, set the later snapshots aside first (rank 0, before resuming: "
            f"ringtrain.checkpoint.rewind.set_aside_after({str(root)!r}, STEP, into=DIR); "
            "ringtrain train --resume-from STEP), or save into another directory")
