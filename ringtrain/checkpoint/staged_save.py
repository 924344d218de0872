"""A save in two halves: the state's tensors first, the caller's small state after.

    staged = manager.stage(step, shared={"strategy": ...}, per_rank={"strategy": ...},
                           updated=strategy.updated_state())
    ...                          # the metrics line: reading the loss waits for the device
    result = staged.save(metadata, shared={"trainer": ...}, per_rank={"step": step, "rng": ...})
    # or staged.drop(): nothing saved (a caller that decides against the save after all)

`SnapshotManager.save` is `stage(...).save(metadata)`. Why two halves: in the background, the
first half makes the host copy (`host_copy.py`), Python work per tensor (tens of milliseconds
for a 100 M-parameter GPT and its AdamW state, measured on an H200 in session 16) whose device
copies are only queued. Made before anything waits for the device, that work runs while the
device still trains the step the host queued; made after the metrics line's read of the loss
(a wait for the device), the device idles through all of it, every snapshot step. The small
state added by the second half (the loop's step, metrics window, RNG) is what the metrics line
changes, so it is read after it.

Synchronous saves (`background` off) write everything in `save`: nothing to hide, the halves
only gather the arguments. What `save` is given is merged into the first half's dicts by key;
a key in both is refused (the caller would lose one of them).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ringtrain.checkpoint.files import SaveResult

__all__ = ["StagedSave"]

log = logging.getLogger("ringtrain")


class StagedSave:
    """One save between its halves (made by `SnapshotManager.stage`; see the module).

    Args:
        manager: the `SnapshotManager` saving.
        step: the step saved.
        keys: the save's store keys (numbered when staged: every rank stages in the same order).
        shared, per_rank: the first half's state: copied already when `staged` is given.
        staged: the background's `StagedCopy` of (shared, per_rank), or None (a synchronous
            save: `shared` and `per_rank` are the caller's own, written by `save`).
    """

    def __init__(self, manager: Any, step: int, keys: str, shared: dict | None,
                 per_rank: dict | None, staged: Any = None):
        self.manager, self.step, self.keys = manager, step, keys
        self.shared, self.per_rank, self.staged = shared, per_rank, staged
        self._done = False

    def save(self, metadata: dict[str, Any] | None = None, *, shared: dict | None = None,
             per_rank: dict | None = None) -> SaveResult:
        """The second half: `shared` and `per_rank` added (small state: deep-copied in the
        background, where the caller may change them meanwhile), then the write, in the step
        or by the background's writer. Returns and raises what `SnapshotManager.save` does."""
        if self._done:
            raise RuntimeError(f"the staged save of step {self.step} was saved or dropped "
                               "already: stage the next one with SnapshotManager.stage")
        self._done = True
        m = self.manager
        background = self.staged is not None
        if background:  # the caller's dicts may change while the writer reads them
            shared, per_rank, metadata = copy.deepcopy((shared, per_rank, metadata))
        all_shared = _merged(self.shared, shared, "shared", self.step)
        all_rank = _merged(self.per_rank, per_rank, "per_rank", self.step)
        if not background:
            return m._save_now(self.keys, self.step, all_shared, all_rank, metadata)
        staged, step, keys = self.staged, self.step, self.keys
        reason = (metadata or {}).get("reason", "periodic")  # metadata is rank 0's alone
        bg = m.background_saves

        def write() -> SaveResult:
            staged.finish()  # first: the step's optimizer waits for it (the copies landed)
            result = m._save_now(keys, step, all_shared, all_rank, metadata)
            log.info("snapshot of step %d (%s): %.1f MB, the step held %.2f s to copy it "
                     "(%.1f MB more copied beside the next step in %.2f s, %s), written in "
                     "the background by a %s in %.2f s -> %s", step, reason,
                     result.total_bytes / 1e6, staged.staged_s, staged.later_bytes / 1e6,
                     staged.overlap_s, staged.path, bg.using, result.total_s, result.path)
            return result

        bg.start(step, write)
        return SaveResult(step, m.root / f"snap-{step:08d}", staged.bytes, staged.bytes, 0.0,
                          staged.staged_s, committed=False)

    def drop(self) -> None:
        """Save nothing of this step: the optimizers step freely again (the copy is let go)."""
        if not self._done and self.staged is not None:
            self.manager.background_saves.drop()
        self._done = True


def _merged(first: dict | None, later: dict | None, name: str, step: int) -> dict | None:
    """`first` with `later`'s keys added (either may be None: None when both are)."""
    if later is None:
        return first
    if first is None:
        return later
    both = sorted(set(first) & set(later), key=str)
    if both:
        raise ValueError(f"the save of step {step}: {name} keys {both} given in both halves; "
                         "give each key in one of them (SnapshotManager.stage or "
                         "StagedSave.save)")
    return {**first, **later}

