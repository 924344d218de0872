"""When the training loop saves a snapshot, and how it stops on a signal.

    snapshots = LoopSnapshots(checkpointer, agreement, state, rank=runtime.rank, background=True)
    with StopSignal(STOP_SIGNALS) as stop:
        ...
        snapshots.save(step)                               # at a snapshot step, or in halves:
        staged = snapshots.stage(step)                     # before the metrics line
        staged.save()                                      # after it (or .drop())
        if agreement.vote(stop.received is not None, at_shared_step=logged):
            return snapshots.stop(step, stop)              # every rank at the same step
    snapshots.wait()                                       # the run's end: the last one written

Apart from the step loop (`trainer.py`) because it is the loop's side of fault tolerance, not
its arithmetic: which signals are caught, no snapshot once a rank has left the job, the
sample log merged before a save, the save and the one line that end a stopped run, and the
saves in the background: the step only copies the state to host memory, a thread writes it
(`SnapshotManager.background`), and this class joins that thread before the next save, at the
run's end and at a stop, turning what it raised into the loop's outcome. What a snapshot holds
and how a run resumes is `ringtrain.checkpoint.resume.Checkpointer`'s business.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ringtrain.checkpoint.loop_save import LoopSave
from ringtrain.checkpoint.resume import Checkpointer
from ringtrain.checkpoint.run_dir import DiskFullError, no_space_message
from ringtrain.checkpoint.snapshot import (
    SnapshotError,
    SnapshotNoSpaceError,
    newest_snapshot_bytes,
)
from ringtrain.checkpoint.stop import StopSignal
from ringtrain.training.state import LoopState

__all__ = ["STOP_SIGNALS", "LoopSnapshots"]

log = logging.getLogger("ringtrain")

# Caught while snapshots are on: every rank saves the same step, then `fit` returns early.
# SIGINT too: Ctrl-C reaches every process of the job (the terminal signals the whole group);
# SIGUSR1: Slurm's warning before the time limit (`sbatch --signal=USR1@90`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class LoopSnapshots:
    """The loop's saves: `Checkpointer.save`, unless a rank has left the job.

    Args:
        checkpointer: saves the loop's and the strategy's state.
        agreement: the strategy's agreement (which ranks are gone; the sample logs gathered).
        state: the loop's `LoopState` (its sample log, if one is kept).
        rank: this process's rank (rank 0 alone says what every rank does).
        background: save in the background (the step copies the state to host memory and goes
            on); False: the whole save in the step (`--sync-snapshots`).
    """

    def __init__(self, checkpointer: Checkpointer, agreement: Any, state: LoopState, *,
                 rank: int, background: bool = True):
        self.checkpointer, self.agreement, self.state, self.rank = (checkpointer, agreement,
                                                                    state, rank)
        self.manager = checkpointer.manager
        self.manager.background = background
        self.off = False  # a rank left the job: no more snapshots
        # The newest committed snapshot while one is in flight (the Checkpointer's `saved_step`
        # is the one in flight), and its size: what a disk-full message names.
        self._committed: int | None = None
        self._committed_bytes: int | None = None
        self._said_slow = False

    def wait(self) -> None:
        """Join the save in flight, if any; raise `DiskFullError` (on every rank) when it found
        the disk full, warn when it failed otherwise (the previous snapshot stays the newest).

        Every rank calls this at the same step (before a save, at the run's end, at a stop),
        and every rank's writer learns the same outcome from rank 0: all decide alike.
        """
        cp, step = self.checkpointer, self.manager.in_flight
        if step is None:
            return
        try:
            result = self.manager.wait()
        except SnapshotNoSpaceError as e:
            log.debug("snapshot of step %d not saved: %s", step, e)
            cp.saved_step = self._committed  # the Checkpointer's word for the newest on disk
            need = self._committed_bytes or newest_snapshot_bytes(self.manager.root)
            raise DiskFullError(no_space_message(self.manager.root, f"the snapshot of step {step}",
                                                 self._committed, need)) from None
        except SnapshotError as e:
            log.warning("warning: snapshot of step %d not saved, training goes on: %s", step, e)
            cp.saved_step = self._committed
            return
        self._committed, self._committed_bytes = step, result.total_bytes

    def close(self) -> None:
        """The run is over: stop the manager's writer process, if one was started (the saves
        were joined by `wait` or `settle` before)."""
        self.manager.close()

    def settle(self) -> None:
        """After an error in the loop: let the save in flight end (bounded by its deadlines), so
        it leaves a committed snapshot or nothing, never a writer still at work behind a
        caller that goes on (a new trainer resuming from the same directory); its own failure
        is only logged, the loop's error is the one that counts."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - the error already leaving the loop matters more
            log.warning("warning: the snapshot in flight did not commit: %s", e)

    def save(self, step: int, reason: str | None = None) -> None:
        """`Checkpointer.save`, unless a rank has left the job: its part would be missing."""
        staged = self.stage(step)
        if staged is not None:
            staged.save(reason)

    def stage(self, step: int) -> LoopSave | None:
        """`save`'s first half, before the step's metrics line (`Checkpointer.stage`: the
        device trains on while the host copies): the returned `LoopSave.save(reason)` writes
        the loop's state as the line left it, `.drop()` nothing. None: no save (a rank left)."""
        if not self.off:
            # One agreement decides it, so every rank skips (or saves) the same step.
            gone = self.agreement.absent_ranks()
            if gone:
                self.off = True
                if self.rank == 0:
                    log.warning("warning: no more snapshots from step %d: ranks %s left the job "
                                "and a snapshot needs every rank's part; training goes on",
                                step, gone)
        if self.off:
            return None
        writing, started = self.manager.writing, time.monotonic()
        self.wait()  # at most one in flight: every rank waits alike, on rank 0's word
        waited = time.monotonic() - started
        # A wait under a second is not worth a line (a tiny model's snapshot every step).
        if writing and waited > 1.0 and not self._said_slow and self.rank == 0:
            self._said_slow = True
            log.warning("warning: the snapshot of step %d waited %.2f s for the one before to "
                        "be written: writing takes longer than --snapshot-every steps, so a "
                        "save waits for the last one (said once); raise --snapshot-every to "
                        "train without waiting", step, waited)
        if self.state.samples is not None:  # every rank's steps since the last snapshot, merged
            self.state.samples.sync(self.agreement.gather)
        self._committed = self.checkpointer.saved_step  # all written: the newest on disk
        return self.checkpointer.stage(step)

    def save_once(self, step: int) -> None:
        """`save`, unless this process saved `step` already (a live job's new rank 0 saves the
        last step's snapshot that the rank 0 lost after that step never wrote)."""
        if self.checkpointer.saved_step != step:
            self.save(step)

    def stop(self, step: int, stop: StopSignal) -> str:
        """Every rank voted to stop at `step`: save it (if not saved yet); the signal's name."""
        cp = self.checkpointer
        # A rank stopped by a peer's vote does not learn which signal: SIGTERM is the
        # one schedulers send, and Ctrl-C reaches every rank itself.
        name = signal.Signals(stop.received).name if stop.received else "SIGTERM"
        if cp.saved_step != step:
            self.save(step, reason=name)
        self.wait()  # never stop before the snapshot that resumes the run is committed
        if self.rank == 0:  # every rank stops at this step: one line says it
            log.warning("warning: stopping at step %d on %s; the snapshot of step %s "
                        "resumes the run (run the same command again)", step, name,
                        cp.saved_step)
        return name
