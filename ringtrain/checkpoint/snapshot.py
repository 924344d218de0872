"""Snapshots: atomic, checksummed, committed-last, saved as a bounded collective step.

    manager = SnapshotManager("runs/x/snapshots")  # rank, world_size: the default group's
    result = manager.save(step, shared={"model": ..., "optimizer": ..., "sampler": ...},
                          per_rank={"rng": get_rng_state()},
                          metadata={"config": ..., "topology": ...})
    manager.background = True     # (or background=True) save() copies the state and returns;
    manager.wait()                # a thread writes it: its result, or its error
    snap = manager.latest()       # the newest committed snapshot that verifies, or None
    shared, per_rank, metadata = manager.load(snap)

Tests: tests/test_checkpoint.py. File-level helpers (durable writes, checksums, manifests,
`unwrap_state_dict`, `check_topology`, `root_path`) live in `ringtrain.checkpoint.files`; the
ranks' handshake (keys, reports, bounded waits) in `ringtrain.checkpoint.handshake`; rank 0's
commit (rename, `COMMITTED` last) and the rotation in `ringtrain.checkpoint.commit`. This file
holds the manager: the order of one save, each rank's own part (written in a thread, bounded by
the deadline), finding and loading snapshots; a background save's host copy and writer thread
are `ringtrain.checkpoint.background`.

Layout under `root_dir` (a directory every rank sees, e.g. on a shared filesystem):

    snap-00000100/  shared.pt  rank0.pt .. rank{N-1}.pt  manifest.json  COMMITTED
    .tmp-snap-00000200-<id>/   a save in progress (or one that crashed): never read

One save: rank 0 creates the temp directory and tells the others its name through the process
group's key-value store; every rank writes and fsyncs its part (`shared` by rank 0 only,
`rank{r}.pt` by each) and reports its files' SHA-256 (or its error) to the store; rank 0 waits for
all reports until the deadline, writes `manifest.json`, renames the directory to `snap-{step}`,
writes `COMMITTED` last, and publishes the outcome, which the other ranks wait for. Every wait has
a deadline, so a slow or failed rank makes `save` raise `SnapshotError` naming that rank on every
rank instead of hanging. Every rank raises what rank 0 published, so all agree on the kind:
`SnapshotNoSpaceError` when any rank's disk was full. A save that fails removes its temp directory;
a crash at any point leaves a temp directory or one without `COMMITTED`: `latest()` ignores
both, `remove_unfinished` (at the next start) removes the temp ones, the next save all.

In the background (`background = True`; the trainer's default): `save` copies the state to host
memory (what `updated` names beside the caller's next forward and backward, see `host_copy.py`)
and returns, and a thread runs the save above, unchanged: so a crash during the write leaves the
previous snapshot the newest, and every rank learns the same outcome from the store; `wait()`
or the next `save` joins it.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import os
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ringtrain.strategies.base import UpdatedState

from ringtrain.checkpoint.background import BackgroundSaves
from ringtrain.checkpoint.commit import commit, newer_than, retain
from ringtrain.checkpoint.files import (
    SHARED,
    TEMP_PREFIX,
    SaveResult,
    Snapshot,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNoSpaceError,
    check_topology,
    load_model_state_dict,
    manifest_metadata,
    newest_snapshot_bytes,
    read_manifest,
    remove_unfinished,
    root_path,
    snap_dirs,
    unwrap_state_dict,
    write_durably,
)
from ringtrain.checkpoint.files import verify as verify_files
from ringtrain.checkpoint.handshake import (
    failure_report,
    gather_parts,
    publish,
    save_error,
    wait_one,
)
from ringtrain.checkpoint.staged_save import StagedSave
from ringtrain.runtime import get_rank, get_world_size
from ringtrain.store_keys import claim_key
from ringtrain.torch_internals import default_store

__all__ = [
    "SaveResult", "Snapshot", "SnapshotCorruptError", "SnapshotError", "SnapshotManager",
    "SnapshotNoSpaceError", "check_topology", "load_model_state_dict", "newest_snapshot_bytes",
    "remove_unfinished", "unwrap_state_dict",
]

log = logging.getLogger("ringtrain")


class SnapshotManager:
    """Save and find snapshots under `root_dir`; `save` is a collective call on every rank.

    Args:
        root_dir: directory for the snapshots, the same one on every rank (shared filesystem).
        rank, world_size: this process's place among the ranks saving together (default group's).
        store: key-value store those ranks share, for the bounded handshake; default the
            default process group's store. Not needed when world_size == 1.
        keep: committed snapshots to keep (the newest `keep`; at least 1, 2 survives corruption).
        timeout_s: how long each rank may take to write its part once rank 0 has started the
            save (and to wait for rank 0 to start it); every rank returns or raises within
            about 2 * timeout_s of rank 0 starting, 3 * timeout_s of its own call at worst.
        name: names this manager's store keys, the same on every rank. A second manager of
            this rank for the same directory on the same store (a new trainer resuming in the
            same process group) needs another name: ValueError otherwise, as it would read the
            first one's stale keys.

    With `background=True` (or the attribute set later; the trainer's default, unless
    `--sync-snapshots`) `save` copies the state to host memory and returns, a thread writing
    it; `wait()` (or the next `save`, or `close()`) joins that thread and raises its error.
    """

    def __init__(
        self, root_dir: str | os.PathLike, *, rank: int | None = None,
        world_size: int | None = None, store: dist.Store | None = None, keep: int = 2,
        timeout_s: float = 60.0, name: str = "snapshots", background: bool = False,
    ) -> None:
        self.root = root_path(root_dir, "SnapshotManager")
        if rank is None or world_size is None:  # the default group's (init_distributed first)
            rank, world_size = (get_rank() if rank is None else rank,
                                get_world_size() if world_size is None else world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {world_size - 1}]")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 committed snapshot "
                             "(2 survives a corrupt one)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: it must be positive")
        self.rank, self.world_size, self.keep, self.timeout_s = rank, world_size, keep, timeout_s
        if store is None and world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"world_size={world_size} needs a store shared by the ranks: "
                                 "call ringtrain.init_distributed() first, or pass store=")
            store = default_store()
        self.store = store
        self._saves = 0  # every rank calls save in the same order, so this numbers them alike
        # A restarted job may reuse torchrun's store: the restart keeps its keys apart. Managers
        # of one process are kept apart by their directory and the caller's name, which every
        # rank gives alike whatever order it makes them in (never by a count of managers made).
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        where = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.name = name
        self._prefix = f"ringtrain/snapshot/{restart}/{where}/{name}"
        if store is not None:  # one rank alone uses no keys
            claim_key(store, self._prefix, rank, "SnapshotManager", name)
        # Saves in the background: `save` copies the state and returns; see `wait`. The
        # handshake of a background save goes through the store only, never a collective: a
        # collective on the writer's thread could interleave with the step's own collectives on
        # the same process group (their order must be the same on every rank), and a gloo group
        # of its own would cost every rank a connection to every other at start. The store's
        # client serialises its requests (TCPStore holds a lock per operation), so the step
        # loop and a watchdog may use it meanwhile.
        self.background = background
        # The host copy, the writer (`.writer`: "auto", "process" or "thread"), the save in flight.
        self.background_saves = BackgroundSaves()

    # ---- saving ------------------------------------------------------------------------------

    def save(
        self, step: int, shared: dict[str, Any] | None = None,
        per_rank: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
        updated: UpdatedState | None = None,
    ) -> SaveResult:
        """Write one snapshot; call on every rank at the same step.

        Args:
            step: the trainer step the state belongs to (names the directory `snap-{step:08d}`).
            shared: state equal on every rank (model, optimizer, sampler state in DDP); only
                rank 0's is written, other ranks may pass None.
            per_rank: this rank's own state (RNG; a pipeline stage's parameters), `rank{r}.pt`.
            metadata: JSON-able facts (config, topology); `step` and `world_size` are added.
            updated: in the background, the tensors only these optimizers' `step()` changes
                (`Strategy.updated_state()`): their host copy runs beside the caller's next
                forward and backward, and the optimizers' next `step()` waits for it
                (`host_copy.py`'s rule). None: everything is copied before `save` returns.

        Raises `SnapshotError` on every rank, naming the rank, when a rank fails to write its
        part or does not finish within `timeout_s` (`SnapshotNoSpaceError` on every rank when a
        disk was full); the temp directory is removed and the previous snapshot stays the newest.

        With `background` on, it returns once the state is copied to host memory (the result
        says `committed=False`, its sizes are the bytes copied by this rank); a thread writes,
        checksums, fsyncs and commits it, exactly as above, while the caller goes on. Its
        outcome (and any of the errors above) comes from `wait()`, or from the next `save`,
        which waits for it first: at most one save is in flight.
        """
        return self.stage(step, shared, per_rank, updated).save(metadata)

    def stage(self, step: int, shared: dict[str, Any] | None = None,
              per_rank: dict[str, Any] | None = None,
              updated: UpdatedState | None = None) -> StagedSave:
        """The first half of `save` (every rank, in the same order): waits for the save in
        flight, then in the background copies `shared` (rank 0's) and `per_rank` to host
        memory as `save` does; the returned `StagedSave.save(metadata, shared=, per_rank=)`
        adds the caller's small state and writes, or `.drop()` saves nothing
        (`ringtrain.checkpoint.staged_save`: why the loop reads its own state in between)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step={step!r}: a snapshot's step is an int >= 0: the training step")
        step = int(step)  # a NumPy integer too
        self.wait()  # at most one save in flight; raises the failure of the one before
        if later := newer_than(self.root, step):  # every rank: the same directory, the same no
            raise ValueError(later)
        keys = f"{self._prefix}/{self._saves}"
        self._saves += 1
        if not self.background:
            return StagedSave(self, step, keys, shared, per_rank)
        staged = self.background_saves.stage((shared if self.rank == 0 else None, per_rank),
                                             updated)
        return StagedSave(self, step, keys, *staged.state, staged=staged)

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, if any (`background` on): its result, or its error.

        Raises what the save raised (`SnapshotError`, `SnapshotNoSpaceError`, ... as `save`
        does in the foreground), once: on every rank alike, as each rank learns the outcome of
        the same save from rank 0. None when no save was in flight.
        """
        return self.background_saves.wait()

    def close(self) -> None:
        """Wait for the save in flight (take its error from `wait` first), then stop the writer
        process, if one was started."""
        self.background_saves.close()

    @property
    def in_flight(self) -> int | None:
        """The step of the save in the background that `wait()` has not joined yet, or None."""
        return self.background_saves.in_flight

    @property
    def writing(self) -> bool:
        """True while a save in the background is still being written (`wait()` would block)."""
        return self.background_saves.writing

    def _save_now(self, keys: str, step: int, shared, per_rank, metadata) -> SaveResult:
        """One save, start to commit, on the calling thread (the caller's or the writer's)."""
        t0 = time.monotonic()
        if self.rank == 0:
            tmp = self.root / f"{TEMP_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
            try:
                meta = manifest_metadata(metadata, step=step, world_size=self.world_size)
                self.root.mkdir(parents=True, exist_ok=True)
                tmp.mkdir()
            except Exception as e:
                error = save_error(f"rank 0 could not start snapshot step {step}: {e!r}", e)
                publish(self.store, f"{keys}/start", failure_report(error))
                if isinstance(e, OSError):  # the disk's fault: the same error as a failed write
                    raise error from None
                raise  # a wrong argument: the caller's bug
            publish(self.store, f"{keys}/start", {"dir": tmp.name})
        else:
            tmp = self.root / wait_one(self.store, f"{keys}/start", t0 + self.timeout_s,
                                       "start the save", rank=self.rank,
                                       timeout_s=self.timeout_s)["dir"]
        # Deadlines count from rank 0's start, so a rank that waited for it is not penalised.
        deadline = time.monotonic() + self.timeout_s

        files, write_s, error = self._write_part(tmp, step, shared if self.rank == 0 else None,
                                                 per_rank, deadline)
        if self.rank != 0:
            publish(self.store, f"{keys}/part/{self.rank}",
                    failure_report(error) if error else {"files": files})
            # Even after its own failure it waits for rank 0's outcome (which names this failure):
            # every rank raises the same kind of error, so all decide alike whether to go on.
            done = wait_one(self.store, f"{keys}/commit", deadline + self.timeout_s,
                            "commit the save", rank=self.rank, timeout_s=self.timeout_s)
            mine = sum(f["bytes"] for f in files.values())
            return SaveResult(step, self.root / done["dir"], mine, done["bytes"], write_s,
                              time.monotonic() - t0)
        try:
            errors = [error] if error else []
            parts, late = gather_parts(self.store, f"{keys}/part", deadline, step,
                                       world_size=self.world_size, timeout_s=self.timeout_s)
            errors += late
            if errors:
                full = any(isinstance(e, SnapshotNoSpaceError) for e in errors)
                raise (SnapshotNoSpaceError if full else SnapshotError)("; ".join(map(str, errors)))
            for part in parts:
                files.update(part)
            final = commit(self.root, tmp, step, files, meta, world_size=self.world_size)
        except Exception as e:
            # Free the space first: the message the ranks print says how much is left.
            shutil.rmtree(tmp, ignore_errors=True)
            error = e if isinstance(e, SnapshotError) else save_error(
                f"rank 0 could not commit snapshot step {step}: {e!r}", e)
            publish(self.store, f"{keys}/commit", failure_report(error))
            if isinstance(e, SnapshotError | OSError):
                raise error from None
            raise  # a bug, not the disk: its own traceback
        total = sum(f["bytes"] for f in files.values())
        publish(self.store, f"{keys}/commit", {"dir": final.name, "bytes": total})
        retain(self.root, self.keep, final)
        mine = sum(f["bytes"] for name, f in files.items() if name in (SHARED, "rank0.pt"))
        return SaveResult(step, final, mine, total, write_s, time.monotonic() - t0)

    def _write_part(self, tmp: Path, step: int, shared, per_rank, deadline: float):
        """Write this rank's files in a thread, so a stuck disk costs at most the deadline.

        Returns (files, seconds, error): error is None or the `SnapshotError` to report.
        """
        files: dict[str, Any] = {}
        failure: list[BaseException] = []

        # Looked up here, not bound at import: a test gates the writer by patching this name.
        write_file = self.background_saves.write_file() if self.background else None
        write_file = write_file or write_durably

        def write():
            try:
                if shared is not None:
                    files[SHARED] = write_file(tmp / SHARED, shared)
                if per_rank is not None:
                    files[f"rank{self.rank}.pt"] = write_file(tmp / f"rank{self.rank}.pt",
                                                              per_rank)
            except BaseException as e:  # noqa: BLE001 - reported to every rank below
                failure.append(e)

        t = time.monotonic()
        writer = threading.Thread(target=write, name=f"snapshot-{step}-rank{self.rank}",
                                  daemon=True)
        writer.start()
        writer.join(max(0.0, deadline - t))
        write_s = time.monotonic() - t
        if writer.is_alive():
            return files, write_s, SnapshotError(
                f"rank {self.rank} did not finish writing its part of snapshot step {step} within "
                f"timeout_s={self.timeout_s:g} (slow disk?)")
        if failure:
            return files, write_s, save_error(
                f"rank {self.rank} failed to write its part of snapshot step {step}: "
                f"{failure[0]!r}",
                failure[0])
        return files, write_s, None

    # ---- finding and loading -----------------------------------------------------------------

    def snapshots(self) -> list[Snapshot]:
        """Committed snapshots with a readable manifest, newest first (checksums not verified)."""
        out = []
        for p in snap_dirs(self.root):
            try:
                out.append(Snapshot(p, int(p.name[5:]), read_manifest(p)))
            except SnapshotError:
                continue
        return out

    def latest(self, verify: bool = True) -> Snapshot | None:
        """The newest committed snapshot whose files match their checksums, or None.

        Skipped snapshots (no COMMITTED marker, or corrupt) are named in a warning with the
        reason. With `verify`, every file is hashed, on every rank that calls this, so that all
        ranks agree on the choice even when only one rank's file is damaged.
        """
        for p in snap_dirs(self.root):
            try:
                manifest = read_manifest(p)
                if verify:
                    verify_files(p, manifest)
            except SnapshotError as e:
                warnings.warn(f"skipping snapshot {p}: {e}", stacklevel=2)
                continue
            return Snapshot(p, int(p.name[5:]), manifest)
        return None

    def load(
        self, snapshot: Snapshot, rank: int | None = None, *, weights_only: bool = True,
        map_location: str | torch.device = "cpu",
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
        """Read `(shared, per_rank, metadata)`; files are checked against the manifest first.

        `per_rank` is None when the snapshot has no file for `rank` (it was written by fewer
        ranks: the caller reshards, see `check_topology`). `weights_only=True` reads tensors and
        plain containers only; pass False for state that pickles arbitrary objects.
        """
        if snapshot is None:
            raise TypeError("load(None): latest() is None where no committed snapshot verifies "
                            "(start afresh then); pass a Snapshot from latest() or snapshots()")
        rank = self.rank if rank is None else rank
        names = [n for n in (SHARED, f"rank{rank}.pt") if n in snapshot.manifest["files"]]
        verify_files(snapshot.path, snapshot.manifest, names)
        loaded = {n: torch.load(snapshot.path / n, map_location=map_location,
                                weights_only=weights_only)
                  for n in names}
        return loaded.get(SHARED), loaded.get(f"rank{rank}.pt"), snapshot.metadata
