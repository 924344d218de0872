"""`Checkpointer.stage`'s result: a snapshot whose strategy state is copied, the loop's not yet.

    staged = checkpointer.stage(step)    # the strategy's state: copied (on CUDA: queued)
    ...                                  # the metrics line, which waits for the device
    staged.save()                        # the loop's state as the line left it, then the write

`ringtrain.checkpoint.staged_save` says why the halves (the device keeps training while the
host copies); this is the loop's side of it, apart from `resume.py` (the Checkpointer itself).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ringtrain.checkpoint.files import SaveResult
from ringtrain.checkpoint.rng import get_rng_state
from ringtrain.checkpoint.staged_save import StagedSave

__all__ = ["LoopSave"]

log = logging.getLogger("ringtrain")


class LoopSave:
    """A `Checkpointer.stage`d save: `save(reason)` adds the loop's state (its step, metrics
    window, RNG, the trainer's totals) as it is now and writes; `drop()` saves nothing."""

    def __init__(self, checkpointer: Any, staged: StagedSave, start: float):
        # checkpointer: the `Checkpointer` that staged it (not imported: resume.py imports this)
        self.checkpointer, self.staged, self.start = checkpointer, staged, start

    def save(self, reason: str | None = None) -> SaveResult | None:
        cp = self.checkpointer
        st, step = cp.state, self.staged.step
        if reason is None:  # a due one: every --snapshot-every steps, or the run's last step
            reason = "periodic" if cp.every and step % cp.every == 0 else "last step"
        window_sum = cp.agreement.sum(list(st.window))  # every rank: for a resume on other ranks
        per_rank: dict[str, Any] = {"step": step, "rng": get_rng_state(), **st.window_state()}
        shared = meta = None
        if cp.runtime.rank == 0:
            shared = {"trainer": st.state_dict(), "window_sum": window_sum}
            meta = {"config": cp.config, "topology": cp._topology(), "reason": reason,
                    "global_batch": cp.global_batch, "batch_size": cp.batch_size,
                    "grad_accum": cp.grad_accum, "replicated": cp.replicated}
        with cp._failures(step):
            result = self.staged.save(meta, shared=shared, per_rank=per_rank)
            cp.saved_step = step
            cp.saves.append((time.perf_counter() - self.start, result.total_bytes))
            # A save in the background says its one line when it commits (the writer's); here
            # it has only been copied to host memory.
            log.log(logging.INFO if result.committed else logging.DEBUG,
                    "snapshot of step %d (%s): %.1f MB in %.2f s -> %s", step, reason,
                    result.total_bytes / 1e6, cp.saves[-1][0], result.path)
            return result
        return None

    def drop(self) -> None:
        self.staged.drop()
