"""When the training loop saves a snapshot, and how it stops on a signal.

    snapshots = LoopSnapshots(checkpointer, agreement, state, rank=runtime.rank)
    with StopSignal(STOP_SIGNALS) as stop:
        ...
        snapshots.save(step)                               # at a snapshot step
        if agreement.vote(stop.received is not None, at_shared_step=logged):
            return snapshots.stop(step, stop)              # every rank at the same step

Apart from the step loop (`trainer.py`) because it is the loop's side of fault tolerance, not
its arithmetic: which signals are caught, no snapshot once a rank has left the job, the
sample log merged before a save, and the save and the one line that end a stopped run. What a
snapshot holds and how a run resumes is `ringtrain.checkpoint.resume.Checkpointer`'s business.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from ringtrain.checkpoint.resume import Checkpointer
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
    """

    def __init__(self, checkpointer: Checkpointer, agreement: Any, state: LoopState, *,
                 rank: int):
        self.checkpointer, self.agreement, self.state, self.rank = (checkpointer, agreement,
                                                                    state, rank)
        self.off = False  # a rank left the job: no more snapshots

    def save(self, step: int, reason: str = "periodic") -> None:
        """`Checkpointer.save`, unless a rank has left the job: its part would be missing."""
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
            return
        if self.state.samples is not None:  # every rank's steps since the last snapshot, merged
            self.state.samples.sync(self.agreement.gather)
        self.checkpointer.save(step, reason=reason)

    def stop(self, step: int, stop: StopSignal) -> str:
        """Every rank voted to stop at `step`: save it (if not saved yet); the signal's name."""
        cp = self.checkpointer
        # A rank stopped by a peer's vote does not learn which signal: SIGTERM is the
        # one schedulers send, and Ctrl-C reaches every rank itself.
        name = signal.Signals(stop.received).name if stop.received else "SIGTERM"
        if cp.saved_step != step:
            self.save(step, reason=name)
        if self.rank == 0:  # every rank stops at this step: one line says it
            log.warning("warning: stopping at step %d on %s; the snapshot of step %s "
                        "resumes the run (run the same command again)", step, name,
                        cp.saved_step)
        return name
