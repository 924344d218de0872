"""Snapshot files: durable writes, checksums, manifests; model-state and topology helpers.

The file-level half of `ringtrain.checkpoint.snapshot` (whose `SnapshotManager` runs the collective
save): everything here works on one directory and needs no process group.

    info = write_durably(path, state)          # torch.save + fsync; {"sha256", "bytes"}
    manifest = read_manifest(snapshot_dir)     # checked against the COMMITTED marker's digest
    verify(snapshot_dir, manifest)             # every file against the manifest's checksums

Tests: `.venv/bin/pytest -q tests/test_checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "COMMITTED", "MANIFEST", "SHARED", "SnapshotCorruptError", "SnapshotError",
    "SnapshotNoSpaceError", "TEMP_PREFIX", "check_topology", "fsync_dir", "load_model_state_dict",
    "manifest_metadata",
    "newest_snapshot_bytes", "read_manifest", "remove_unfinished", "sha256_file", "snap_dirs",
    "unwrap_state_dict", "verify", "write_durably",
]

COMMITTED, MANIFEST, SHARED = "COMMITTED", "manifest.json", "shared.pt"
TEMP_PREFIX = ".tmp-snap-"  # a save in progress, or one that died: never read


class SnapshotError(RuntimeError):
    """A save that did not commit (a rank failed or was too slow), or a snapshot that cannot be
    used."""



class SnapshotCorruptError(SnapshotError):
    """A snapshot whose files do not match the checksums recorded when it was committed."""


class SnapshotNoSpaceError(SnapshotError):
    """A save that did not commit because a rank's disk (or quota) was full: retrying won't help."""


# ---- model state -------------------------------------------------------------------------------


def unwrap_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Strip the `module.` that DDP wrappers put before every key; other dicts pass unchanged.

    Only when *every* key has the prefix, so a model that merely has a child named `module`
    next to others keeps its keys.
    """
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return type(state_dict)((k[len("module."):], v) for k, v in state_dict.items())
    return state_dict


def load_model_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
    """Load a model state saved with or without `module.` into a wrapped or plain model."""
    target = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return target.load_state_dict(unwrap_state_dict(state_dict), strict=strict)


def manifest_metadata(metadata: dict[str, Any] | None, *, step: int,
                      world_size: int) -> dict[str, Any]:
    """The caller's metadata with `step` and `world_size`, checked JSON-able before any write."""
    meta = dict(metadata or {})
    for key, value in (("step", step), ("world_size", world_size)):
        if meta.setdefault(key, value) != value:
            raise ValueError(f"metadata[{key!r}]={meta[key]!r} but save has {key}={value}")
    try:
        json.dumps(meta)  # fail before writing anything
    except TypeError as e:
        raise TypeError(
            f"metadata goes into manifest.json and must be JSON-able: {e}") from None
    return meta


def check_topology(
    metadata: dict[str, Any], world_size: int, reshardable: bool, topology: dict | None = None
) -> bool:
    """Refuse a snapshot from another topology unless the state can be resharded.

    Returns True when the world size or topology differ (the caller re-splits data and
    per-rank state), False when they are the same. Raises `SnapshotError` with both world sizes
    when they differ and `reshardable` is False.
    """
    saved_ws, saved_topo = metadata.get("world_size"), metadata.get("topology")
    if saved_ws is None:
        raise SnapshotError(f"snapshot metadata has no world_size (keys: {sorted(metadata)})")
    same = saved_ws == world_size and (topology is None or saved_topo in (None, topology))
    if same or reshardable:
        return not same
    raise SnapshotError(
        f"snapshot of step {metadata.get('step')} was written by world_size={saved_ws} "
        f"(topology {saved_topo}) but this run has world_size={world_size} (topology {topology}), "
        f"and this state cannot be resharded; resume with world_size={saved_ws} and the same "
        "topology, or start from scratch in a new run directory"
    )


# ---- files -------------------------------------------------------------------------------------


PARALLEL_HASH_MIN_BYTES = 1 << 18  # smaller writes (torch.save's headers) hash in line
WRITEBACK_BYTES = 64 << 20  # the disk's write is started every this many bytes written


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it.

    It keeps the first `OSError` a write raised: torch.save reports a failed write only as
    "[enforce fail at inline_container.cc] unexpected pos", which hides the full disk.

    `parallel`: a large write is hashed on a second thread while this one writes it (sha256
    and the write both release the GIL), so it costs the slower of the two, not their sum:
    sha256 runs at 0.6-2 GB/s, no faster than the page cache takes the bytes (a 600 MB state:
    1.39 s hashed and serialised, 0.51 s serialised alone, here). The call waits for its hash
    before it returns: torch.save's buffer is only valid during the call. False: one after the
    other (the reference; the same digest). `writeback`: start the disk's write every
    WRITEBACK_BYTES (`_write_back`); False: all of it in the caller's fsync (the reference).
    """

    def __init__(self, f, parallel: bool = True, writeback: bool = True):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0
        self.error: OSError | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256") if parallel else None
        self._written_back = 0 if writeback and hasattr(os, "posix_fadvise") else None

    def write(self, data) -> int:
        self.bytes += len(data)
        hashed = None
        if self._pool is not None and memoryview(data).nbytes >= PARALLEL_HASH_MIN_BYTES:
            hashed = self._pool.submit(self.sha256.update, data)
        else:
            self.sha256.update(data)
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        finally:
            if hashed is not None:
                hashed.result()
        if self._written_back is not None and self.bytes - self._written_back >= WRITEBACK_BYTES:
            self._write_back()
        return n

    def _write_back(self) -> None:
        """Start the disk's write of what is written so far, so that it runs while the rest
        is serialised and hashed instead of all of it in the final fsync (Linux starts the
        writeback of a range's dirty pages on POSIX_FADV_DONTNEED, and drops them from the
        page cache once written: a snapshot is not read again soon). Advice only: a
        filesystem that ignores it (tmpfs) loses nothing."""
        try:
            os.posix_fadvise(self.f.fileno(), self._written_back, self.bytes - self._written_back,
                             os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, io.UnsupportedOperation):  # not a real file: no advice
            self._written_back = None
            return
        self._written_back = self.bytes

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        """Stop the hashing thread (the file is the caller's to close)."""
        if self._pool is not None:
            self._pool.shutdown()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, obj: Any, *, parallel: bool = True,
                  writeback: bool = True) -> dict[str, Any]:
    """torch.save `obj` (or raw bytes) to `path`, fsync it; return its checksum and size.

    `parallel`: hash large writes beside them; `writeback`: start the disk's write before the
    fsync (`_HashingWriter`); False: the reference, one after the other. The same file either
    way.

    A failed write raises the `OSError` that caused it (errno ENOSPC on a full disk), with
    no chain of follow-up errors from torch or from closing the file.
    """
    f = open(path, "wb")  # noqa: SIM115 - closed below; quietly when the write already failed
    w = _HashingWriter(f, parallel=parallel, writeback=writeback)
    try:
        if isinstance(obj, bytes):
            w.write(obj)
        else:
            torch.save(obj, w)  # hashed while written: no second read, no in-memory copy
        f.flush()
        os.fsync(f.fileno())
    except BaseException as e:
        with contextlib.suppress(OSError):
            f.close()  # its flush fails the same way on a full disk; the first error says why
        if w.error is not None and e is not w.error:
            raise w.error from None
        raise
    finally:
        w.close()
    f.close()
    return {"sha256": w.sha256.hexdigest(), "bytes": w.bytes}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked against the digest that COMMITTED recorded for it."""
    if not (path / COMMITTED).is_file():
        raise SnapshotError(f"{path.name} has no {COMMITTED} marker (a save that did not finish)")
    try:
        expected = json.loads((path / COMMITTED).read_text())["manifest_sha256"]
        raw = (path / MANIFEST).read_bytes()
    except (OSError, ValueError, KeyError) as e:
        raise SnapshotCorruptError(f"{path.name}: unreadable {COMMITTED} or {MANIFEST}: {e}") from e
    if hashlib.sha256(raw).hexdigest() != expected:
        raise SnapshotCorruptError(f"{path.name}/{MANIFEST}: sha256 differs from the one committed")
    return json.loads(raw)


def root_path(root_dir: Any, owner: str) -> Path:
    """`root_dir` as a Path, or a TypeError naming `owner`'s argument (not pathlib's)."""
    if not isinstance(root_dir, (str, os.PathLike)) or not str(root_dir):
        raise TypeError(f"{owner}(root_dir={root_dir!r}): give the directory the snapshots go in, "
                        "a str or Path that every rank sees (e.g. 'runs/mine/snapshots')")
    return Path(root_dir)


def snap_step(path: Path) -> int:
    """The step of a `snap-{step:08d}` directory."""
    return int(path.name[5:])


def snap_dirs(root: Path) -> list[Path]:
    """`snap-*` directories, newest step first (committed or not)."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("snap-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=snap_step, reverse=True)


def remove_unfinished(root_dir: str | os.PathLike) -> list[Path]:
    """Remove the temp directories of saves that never finished (a crash, a full disk).

    Call once, on one process, before any rank saves (a run's start): a save in progress
    writes into one. Committed snapshots and replaced ones (`.old-snap-*`) are left alone.
    """
    root = Path(root_dir)
    found = sorted(p for p in root.glob(f"{TEMP_PREFIX}*") if p.is_dir()) if root.is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def newest_snapshot_bytes(root_dir: str | os.PathLike) -> int | None:
    """Size of the newest committed snapshot under `root_dir` (from its manifest), or None."""
    for p in snap_dirs(Path(root_dir)):
        try:
            return sum(f["bytes"] for f in read_manifest(p)["files"].values())
        except SnapshotError:
            continue
    return None


def verify(path: Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    for name in names if names is not None else list(manifest["files"]):
        expected = manifest["files"][name]["sha256"]
        try:
            actual = sha256_file(path / name)
        except OSError as e:
            raise SnapshotCorruptError(f"{path.name}/{name}: unreadable ({e})") from e
        if actual != expected:
            raise SnapshotCorruptError(
                f"{path.name}/{name}: sha256 {actual[:12]}... but {expected[:12]}... was committed"
            )


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot on disk; `manifest` holds its files' checksums and its metadata."""

    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest["metadata"]


@dataclass(frozen=True)
class SaveResult:
    """What one `save` did, for the trainer's log. Times in seconds."""

    step: int
    path: Path
    bytes: int  # written by this rank
    total_bytes: int  # written by all ranks
    write_s: float  # this rank serialising and fsyncing its files
    total_s: float  # the whole collective step, waits included (in the background: the copy)
    # False: a save in the background, copied to host memory but not yet written or committed
    # (`SnapshotManager.wait` says how it ended); bytes are then the bytes copied by this rank.
    committed: bool = True
