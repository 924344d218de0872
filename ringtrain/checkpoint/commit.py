"""Rank 0's directory work after a save's parts are in: commit, then rotation.

`commit` turns the temp directory into `snap-{step:08d}`: manifest, fsync, rename, the
`COMMITTED` marker last (a snapshot of the same step saved again replaces the old one, which
is put back if the commit fails). `retain` keeps the newest `keep` committed snapshots and
removes the debris of crashed and replaced saves. Kept apart from `snapshot.py` because this
is one process renaming directories, no ranks and no store; the layout it writes is described
in `snapshot.py`'s docstring, the files in `files.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ringtrain.checkpoint.files import COMMITTED, MANIFEST, fsync_dir, snap_dirs, write_durably


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


def retain(root: Path, keep: int) -> None:
    """Rank 0, after a commit: keep the newest `keep` committed snapshots, drop the debris."""
    dirs = snap_dirs(root)
    committed = [p for p in dirs if (p / COMMITTED).is_file()]
    stale = committed[keep:] + [p for p in dirs if p not in committed]
    stale += [p for p in root.glob(".*-snap-*") if p.is_dir()]  # temp and replaced dirs
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
