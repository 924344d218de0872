"""metrics.jsonl (and the TensorBoard events) on whichever process is rank 0 now.

    metrics = RankZeroMetrics(run_dir, rank=lambda: runtime.rank)
    metrics.open(resume_at=step)   # the run's rank 0, at the start (a resumed run cuts the file)
    metrics.write(record)          # nothing off rank 0; a new rank 0 takes the file over first
    metrics.records                # what this process wrote, and read back on taking over
    metrics.close()

Without `--live` rank 0 never changes: it opens the file at the start and writes every line.
In a live job (`ringtrain train --live`) ranks are per generation, and the process that was rank
0 may be lost (killed, hung, cut off); the current generation's rank 0 then writes. It takes the
file over at its first line, of step s: the lines before s stay, read back so the report at the
end plots the whole run; lines from s on are cut (written before a whole-job restart and trained
again, or the line of s itself, written by a rank 0 that was lost after agreeing it and written
again now: never twice); its TensorBoard event file hides older events from s on, as a resumed
run's does. A process that is no longer rank 0 closes the file and writes no more.
Which lines a new rank 0 writes late (a step whose sum failed when the member was lost) is
`ringtrain.training.record.HeldLine`'s part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ringtrain.training.progress import MetricsLog
from ringtrain.training.tensorboard import TensorBoardLog

__all__ = ["RankZeroMetrics"]

log = logging.getLogger("ringtrain")


class RankZeroMetrics:
    """The run's metrics log, written by the process whose `rank()` is 0 at each line.

    Args:
        run_dir: where metrics.jsonl and tensorboard/ go; None: nowhere (records in memory).
        rank: this process's rank now (a live member's changes with each generation).
    """

    def __init__(self, run_dir: str | None, rank: Callable[[], int]):
        self.run_dir, self.rank = run_dir, rank
        self.log: MetricsLog | TensorBoardLog = MetricsLog(None)
        self.writing = False  # this process holds metrics.jsonl open

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.log.records

    def open(self, resume_at: int | None = None) -> None:
        """At the start, on rank 0: a new file, or a resumed run's cut after `resume_at`."""
        if self.run_dir and self.rank() == 0:
            self._open(resume_at)

    def _open(self, resume_at: int | None) -> None:
        assert self.run_dir is not None
        os.makedirs(self.run_dir, exist_ok=True)
        lines = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"), resume_at=resume_at)
        self.log = TensorBoardLog(lines, self.run_dir, resume_at or 0)  # if installed
        self.writing = True

    def write(self, record: dict[str, Any]) -> None:
        """`record` into metrics.jsonl if this process is rank 0 now (kept in `records` too)."""
        rank0 = self.rank() == 0
        if self.writing and not rank0:  # another process writes from here: never two at once
            self.log.close()
            self.log, self.writing = MetricsLog(None), False
        elif rank0 and not self.writing and self.run_dir:
            step = record["step"]
            # A warning: every member logs those, and a lost writer is a fault's doing.
            log.warning("live: rank 0 now (pid %d): writes metrics.jsonl from step %d on (the "
                        "process that wrote it was lost)", os.getpid(), step)
            self._open(resume_at=step - 1)  # the lines before this one stay, later ones go
        self.log.write(record)

    def close(self) -> None:
        self.log.close()
