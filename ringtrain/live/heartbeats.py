"""`Heartbeats`: this process's beat in the store, and how long each other member has been silent.

    beats = Heartbeats(store, beat_store, uid, heartbeat_s=0.1, dead_after_s=1.0,
                       members=lambda: [0, 1])
    beats.start()                        # a thread: beat, then read every member's counter
    beats.read(store, uid)               # (count, seconds not moved): one counter, read now
    beats.silent()                       # (uid, seconds) of a member silent too long, or None
    beats.stop()

Every process of a live job beats `hb/{uid}` (a store counter) from a thread, whatever its step
is doing, and reads its generation's members' counters after each beat. A counter that has not
moved for `dead_after_s` on this process's clock is a member lost (a SIGKILL, a SIGSTOP, a lost
host); one that is merely slow still beats, since its thread does. `LiveGroup` (group.py) asks
this to decide who is left, and its `WatchedGroup` asks it between the slices of every wait.

A beat is two store requests: its own counter's `add`, then one `multi_get` of the counters
it watches and of `uids` (the registered processes). A counter is read with `add(key, 0)` the
first time, which creates it: `multi_get` of a key not there yet would wait for it, and a
process lost between registering and its first beat would stall this thread, which the others
would then take for this process lost. Measured with 4 members on 2 cores (the clean run of
benchmarks/live_recovery.py, session 18): beating took ~2 % of the machine, ~6 ms of CPU a
second in each member's thread and ~17 ms in the store's process; one request per counter (6
a beat) cost the store 128 us a beat, one `multi_get` 70 us (the beating thread ~100 us
either way, most of it waking up and taking the GIL).

A store that does not answer is nobody's silence: the part of a request's wait beyond
`heartbeat_s` is excused (`excuse`), every member's clock moved on by it. torch's TCP store
serves every client from one thread, which resolves each connecting peer's name
(`getnameinfo`): where reverse DNS is slow, every request waits out the resolver, 5 s on the
test machine in 1 of 3 runs of tests/test_live.py under load, and the first read after the
wait, answered before the members' queued beats, found them all 5 s silent.

.. warning:: Each process reads every member's and every waiting process's counter each
    heartbeat: O(processes^2) counters read per `heartbeat_s` over the job (O(processes)
    requests), fine for tens of processes on one store, not for thousands.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist


class Heartbeats:
    """This process's heartbeat thread and its record of when each counter last moved.

    Args:
        store: the live group's (prefixed) store, for the caller's reads.
        beat_store: the same keys over a connection of the thread's own (`clone_store`), so a
            wait on the caller's connection never delays a beat.
        uid: this process's uid: its counter is `hb/{uid}`.
        heartbeat_s: how often the thread beats and reads the members' counters.
        dead_after_s: a member whose counter has not moved this long is silent.
        members: the uids to watch now (the current generation's), read at every beat.
        known: uids never to be let in again (members past or present, departed), read at
            every beat: every other registered uid (a process waiting to be let in) is
            watched too, but never accused by `silent`. Its silence is then timed before a
            fault, not from the read that proposes it (a warm spare on a host whose link
            went down with the members it would replace looked fresh; issue 26).
    """

    def __init__(self, store: dist.Store, beat_store: dist.Store, uid: int, *,
                 heartbeat_s: float, dead_after_s: float, members: Callable[[], list[int]],
                 known: Callable[[], set[int]] = set):
        self.uid, self.heartbeat_s, self.dead_after_s = uid, heartbeat_s, dead_after_s
        self._store, self._members, self._known = store, members, known
        # uid -> (heartbeat count, when it last moved on our clock); both threads write it
        self._moved: dict[int, tuple[int, float]] = {}
        self._read_at = time.monotonic()  # when the thread last read every counter
        self._excused_until = 0.0  # the end of the last wait `excuse` forgave
        self._created: set[int] = set()  # uids whose counter exists: read by `multi_get`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_store,), daemon=True,
                                        name="ringtrain-live-heartbeat")

    def beat_once(self) -> None:
        """One beat now, from the caller (before the thread runs: see `LiveGroup`)."""
        self._store.add(f"hb/{self.uid}", 1)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5)

    def _beat(self, store: dist.Store) -> None:
        while not self._stop.is_set():
            try:
                sent = time.monotonic()
                store.add(f"hb/{self.uid}", 1)
                self._read_counters(store)
                self.excuse(sent)
                self._read_at = time.monotonic()
            except RuntimeError:  # the store is gone: the job is over, nothing to tell
                return
            self._stop.wait(self.heartbeat_s)

    def _read_counters(self, store: dist.Store) -> None:
        """Observe every member's counter (watched all along, so a failure finds them timed)
        and every waiting process's: one `multi_get` (see the module docstring)."""
        members = self._members()
        skip = set(self._known()) | set(members)  # copied: the caller adds to it
        waiting = [u for u in self._created if u not in skip]
        watched = [u for u in members if u in self._created] + waiting
        *counts, uids = store.multi_get([f"hb/{u}" for u in watched] + ["uids"])
        for u, count in zip(watched, counts, strict=True):
            self.observe(u, int(count))
        for u in [*members, *range(int(uids))]:
            if u not in self._created and (u in members or u not in skip):
                self.read(store, u)  # creates it: `multi_get` from now
                self._created.add(u)

    def _read_counters_naive(self, store: dist.Store) -> None:
        """`_read_counters`, one request per counter (the reference the tests compare with)."""
        members = self._members()
        for u in members:
            self.read(store, u)
        skip = set(self._known()) | set(members)
        for u in range(int(store.add("uids", 0))):
            if u not in skip:
                self.read(store, u)

    def read(self, store: dist.Store, uid: int) -> tuple[int, float]:
        """`uid`'s counter, read now (one request, which creates it), and how long it has not
        moved, the store's own wait excused."""
        sent = time.monotonic()
        count = store.add(f"hb/{uid}", 0)
        self.excuse(sent)
        return count, self.observe(uid, count)

    def excuse(self, sent: float) -> None:
        """A request sent at `sent` was just answered: the part of its wait beyond
        `heartbeat_s` (and not excused already: both threads wait out the same stall) is time
        the store answered nobody, so every watched counter's silence is moved on by it.
        A store answering slowly all along delays finding a lost member by its delays."""
        received = time.monotonic()
        begin = max(sent + self.heartbeat_s, self._excused_until)
        if received <= begin:
            return
        self._excused_until = received
        for u, (count, moved_at) in list(self._moved.items()):
            self._moved[u] = (count, min(received, moved_at + received - begin))

    def observe(self, uid: int, count: int) -> float:
        """Record `uid`'s heartbeat count as read now; how long it has not moved."""
        now = time.monotonic()
        last = self._moved.get(uid)
        if last is None or last[0] != count:
            self._moved[uid] = last = (count, now)
        return now - last[1]

    def silent(self) -> tuple[int, float] | None:
        """A member (not this process) silent for over `dead_after_s`, and for how long.

        Silence is counted up to the thread's last read, not up to now: if this process's own
        thread is starved (a loaded host) or its store link is down, nobody is accused.
        """
        read_at = self._read_at
        for u in self._members():
            moved = self._moved.get(u)
            if u != self.uid and moved is not None and read_at - moved[1] > self.dead_after_s:
                return u, read_at - moved[1]
        return None


def clone_store(store: dist.Store) -> dist.Store:
    """A second connection to `store` where it has one (a TCP store), else `store` itself."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError):  # an in-process store: shared is fine
        return store
