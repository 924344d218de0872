"""What a `Watchdog` does once a failure is found: act once, every rank naming the same peer.

`watchdog.py` runs the watch (heartbeats through the store, the check that finds a dead, hung
or failed peer or a lost store); this module holds what follows a finding, as a base class of
`Watchdog` (`Verdicts`): a failure key written where every rank reads it within one interval
(`_publish`, also used by `report_failure` for this rank's own error); the verdict fired once
(`on_dead`), shared first through the store and, on the rank that hosts the store, held until
the others have read it, so every rank names the same peer even when this rank's exit takes the
store down; and a tolerated peer's departure (`on_departed`), after which the watch goes on.

Kept apart from the heartbeat protocol because it is the part that runs once, at the end, on a
store that may be going away: every store call here tolerates its loss. The watchdog's fields
it uses are set in `Watchdog.__init__` and listed on `Verdicts`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ringtrain.launch.hang import HangCheck
from ringtrain.launch.peer_failure import PeerFailure, describe_error


class Verdicts:
    """Publishing, firing and sharing a `Watchdog`'s verdicts (a base class of it)."""

    # Set by Watchdog.__init__.
    rank: int
    interval_s: float
    _store: dist.Store
    _store_owner: int | None
    _on_dead: Callable[[PeerFailure], None]
    _on_departed: Callable[[PeerFailure], None] | None
    _departed: set[int]
    _watched: set[int]
    _hangs: HangCheck
    _found: PeerFailure | None
    _fired: threading.Event
    _handled: threading.Event
    _fire_lock: threading.Lock

    def _publish(self, failure: PeerFailure) -> None:
        """Write a verdict where every rank reads it within one interval."""
        try:
            self._store.set(f"failed/{failure.rank}", f"{failure.kind}|{failure.reason}")
            self._store.add("nfailed", 1)
        except RuntimeError:
            pass  # the store is gone too: the peers find out through their own timeouts

    def _depart(self, failure: PeerFailure) -> None:
        """A tolerated peer died: stop watching it, say so, and keep watching the others."""
        assert failure.rank is not None
        self._departed.add(failure.rank)
        self._watched.discard(failure.rank)
        self._hangs.forget(failure.rank)
        if self._found is failure:  # read from its failure key: the next round skips that key
            self._found = None
        if self._on_departed is not None:
            try:
                self._on_departed(failure)
            except Exception as e:  # noqa: BLE001 - the watch must go on for the others
                print(f"[rank {self.rank}] watchdog: on_departed({failure}) raised "
                      f"{describe_error(e)}",
                      file=sys.stderr, flush=True)

    def _fire(self, failure: PeerFailure, found_here: bool) -> None:
        with self._fire_lock:
            if self._fired.is_set():
                return
            self._found = failure
            self._fired.set()
        if failure.kind != "store":
            # Share the verdict and count the ranks that reached it, so every rank names the
            # same peer even when this rank's exit takes the store down (outside `ringtrain
            # run` it lives in rank 0's process). Store calls off-thread: it may be gone too.
            seen = PeerFailure(failure.kind, failure.rank,
                               f"{failure.reason}; seen by rank {self.rank}")

            worker = threading.Thread(target=self._share, args=(seen if found_here else None,),
                                      daemon=True)
            worker.start()
            worker.join(timeout=self.interval_s)
            if self._store_owner == self.rank:
                others = len(self._watched - {failure.rank})
                # The others read it within one interval.
                self._await_verdicts(others + 1, time.monotonic() + 2 * self.interval_s)
        self._on_dead(failure)
        self._handled.set()

    def _share(self, verdict: PeerFailure | None) -> None:
        if verdict is not None:
            self._publish(verdict)
        try:
            self._store.add("verdicts", 1)
        except RuntimeError:
            pass

    def _await_verdicts(self, count: int, deadline: float) -> None:
        try:  # our own store: it answers unless this process is wedged
            while self._store.add("verdicts", 0) < count and time.monotonic() < deadline:
                time.sleep(0.01)
        except RuntimeError:
            pass
