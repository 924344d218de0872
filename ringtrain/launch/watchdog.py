"""Dead-rank detection: no rank waits forever on a peer that died or raised.

Every rank runs a `Watchdog` after the process group is up. It publishes a heartbeat counter
through the rendezvous store and watches everyone else's. When a peer raises (it writes a
failure key on its way out), goes silent for `timeout_s`, or the store itself becomes
unreachable (the host that runs it died), this rank prints one line naming the peer and exits
with `PEER_FAILED_EXIT_CODE`, even while its main thread is blocked inside a collective: the
check runs on its own thread, and a thread blocked in a C++ collective has released the GIL.

    with Watchdog(timeout_s=30, name="train") as watchdog:   # after ringtrain.init_distributed()
        for step, batch in enumerate(loader):
            watchdog.set_step(step)
            ...

Try it: `python tests/scripts/watchdog_timing.py` kills, freezes or fails one rank of a job
started without an agent (like ranks on another host) and times how fast the others exit.

Why not rely on the backend: gloo raises at once when a peer's socket closes (~15 ms after a
SIGKILL on the same host: "Connection closed by peer [127.0.0.1]:port"), but not when the peer
is frozen or its host vanishes (it waits for the collective timeout), and it names an address,
not a rank; NCCL waits for its collective timeout (minutes). So an error that looks like a lost
connection is handed to `report_failure`, which waits (bounded) for the watchdog to name the
rank that went silent instead of reporting the symptom.

This file holds the watch: the public surface, the heartbeat protocol over the store (`hb/`,
`step/`, `issued/`, `done/` keys per rank) and the check that finds a dead, hung or failed peer
or a lost store. What follows a finding (the verdict fired once, shared and counted through the
store; a tolerated peer's departure) is in `verdicts.py`, the `Verdicts` base class.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from types import TracebackType

import torch.distributed as dist

from ringtrain.errors import is_connection_lost
from ringtrain.launch.hang import HangCheck, collective_progress
from ringtrain.launch.peer_failure import (
    PeerFailure,
    describe_error,
    exit_on_peer_failure,
    tcp_store,
    uneven_hint,
    write_error_file,
)
from ringtrain.launch.traceback_once import print_once
from ringtrain.launch.verdicts import Verdicts
from ringtrain.runtime import get_runtime
from ringtrain.store_keys import claim_key


class Watchdog(Verdicts):
    """Heartbeats through the store; stops this rank when a peer dies, raises, or the store is lost.

    Args:
        store: the rendezvous store; default `get_runtime().store` (every rank reaches it). The
            watchdog talks through its own clone of it, so a main thread blocked on the store (a
            barrier) does not block the heartbeats.
        rank, world_size: default those of `get_runtime()`.
        interval_s: how often to publish and read heartbeats (each round costs world_size + 2
            store operations on every rank).
        timeout_s: a peer silent for this long is dead; also the bound on losing the store.
        on_dead: called once with a `PeerFailure`; default `exit_on_peer_failure` (prints one
            line, exits with PEER_FAILED_EXIT_CODE). A custom one that returns stops the watch.
        name: names this watchdog's store keys, the same on every rank ("train"); with the
            run and restart (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT) it makes the key
            prefix, so a restarted group never reads stale keys. A second watchdog of this rank
            on the same store needs another name (ValueError otherwise: it would read the
            first one's keys).
        prefix: the whole store key prefix instead (then `name` is only used in messages).
        excepthook: while running, an uncaught exception goes through `report_failure` first.
        tolerate: peers whose death (silence or a raised error) the job survives, e.g. the
            workers of an async parameter server: such a peer is reported to `on_departed`
            and no longer watched, and the watch goes on. A lost store is never tolerated.
        on_departed: called (from the watchdog's thread) with the `PeerFailure` of each
            tolerated peer that died; default: nothing.

    .. warning:: Start it on every rank: a rank without one looks dead to the others after
        `timeout_s`. Call `stop()` (or leave the `with` block) on every rank at the end, so a
        rank that finishes early is not taken for dead.
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 30.0,
        on_dead: Callable[[PeerFailure], None] | None = None,
        name: str = "watchdog",
        prefix: str | None = None,
        excepthook: bool = True,
        tolerate: Collection[int] = (),
        on_departed: Callable[[PeerFailure], None] | None = None,
    ):
        if interval_s <= 0 or timeout_s <= interval_s:
            raise ValueError(
                f"interval_s={interval_s}, timeout_s={timeout_s}: need 0 < interval_s < timeout_s "
                "(a peer is declared dead after timeout_s without a heartbeat; use e.g. "
                "interval_s=1, timeout_s=30)"
            )
        if store is None or rank is None or world_size is None:
            runtime = get_runtime()  # raises a clear error before init_distributed()
            store = runtime.store if store is None else store
            rank = runtime.rank if rank is None else rank
            world_size = runtime.world_size if world_size is None else world_size
        self.rank, self.world_size = rank, world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Invalid rank {self.rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}]")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # After a lost-connection error we know someone is gone: a few missed beats suffice.
        self.suspect_timeout_s = min(timeout_s, max(3 * interval_s, 1.0))
        self._on_dead = on_dead or (lambda failure: exit_on_peer_failure(self.rank, failure))
        self.tolerate = frozenset(tolerate)
        self._on_departed = on_departed
        self._departed: set[int] = set()  # tolerated peers found dead: no longer watched
        # A rank stuck outside the collective the others wait in (ringtrain.launch.hang).
        self._hangs = HangCheck(timeout_s)
        self._published_count = 0
        shared = store  # the caller's store, before the clone: names are claimed on it
        tcp = tcp_store(store)
        self._store_addr = f"{tcp.host}:{tcp.port}" if tcp is not None else "(in-process store)"
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # ringtrain's own rendezvous: rank 0 hosts it
        self._store_owner = None if agent_store else 0
        try:
            store = store.clone()  # its own connection: TCPStore serialises ops per connection
            store.set_timeout(timedelta(seconds=timeout_s))
        except (AttributeError, RuntimeError):
            pass
        if prefix is None:  # from the caller's name: the same on every rank, whatever the order
            prefix = (f"ringtrain/watchdog/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/"
                      f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}")
        claim_key(shared, prefix, self.rank, "Watchdog", name)
        self.name = name
        self._store = dist.PrefixStore(prefix, store)
        self._excepthook = excepthook
        self._previous_hook = None

        self._step = 0
        self._published_step = 0
        self._peers = [r for r in range(self.world_size) if r != self.rank]
        self._watched = set(self._peers)  # peers neither done nor dead
        self._seen: dict[int, int] = {}  # peer -> last heartbeat count read
        self._last_change: dict[int, float] = {}  # peer -> when its count last moved (our clock)
        self._last_step: dict[int, int] = {}
        self._last_ok = 0.0  # when a full round of store operations last succeeded
        self._store_gone_at: float | None = None  # when the store closed our connection
        self._store_error = ""
        self._found: PeerFailure | None = None  # a failure key read from the store
        self._suspect = False  # set when this rank's main thread saw a lost connection
        self._stop = threading.Event()
        self._fired = threading.Event()  # a failure was found and on_dead called
        self._handled = threading.Event()  # on_dead returned
        self._fire_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- public surface -------------------------------------------------------------------

    def start(self) -> Watchdog:
        """Start the heartbeat and check threads (no-op for world_size 1)."""
        if self.world_size == 1 or self._threads:
            return self
        now = time.monotonic()
        self._last_ok = now
        for r in self._peers:
            self._seen[r], self._last_change[r], self._last_step[r] = -1, now, 0
        self._threads = [
            threading.Thread(target=self._beat_loop, name="ringtrain-heartbeat", daemon=True),
            threading.Thread(target=self._check_loop, name="ringtrain-watchdog", daemon=True),
        ]
        for t in self._threads:
            t.start()
        if self._excepthook:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._hook
        return self

    def stop(self, *, done: bool = True) -> None:
        """Stop watching; with `done`, tell the peers this rank finished (so it is not 'dead')."""
        if self._threads and done and not self._stop.is_set():
            try:  # before the heartbeats stop, so no peer ever sees this rank silent
                self._store.add(f"done/{self.rank}", 1)
            except RuntimeError:
                pass  # the store is gone at the end of the job: nobody is left to tell
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():  # stop() may be called from on_dead
                t.join(timeout=self.interval_s + 5)
        self._threads = []
        if self._previous_hook is not None:
            sys.excepthook = self._previous_hook
            self._previous_hook = None

    def set_step(self, step: int) -> None:
        """Record this rank's training step; peers quote it when this rank dies."""
        self._step = int(step)

    @property
    def failure(self) -> PeerFailure | None:
        """The peer failure found so far, if any (set just before `on_dead` is called)."""
        return self._found if self._fired.is_set() else None

    def report_failure(self, exc: BaseException) -> str:
        """Tell the peers this rank is failing with `exc` (call it, then re-raise); returns
        what to say of it (`describe_error`, with the reason when one is known).

        An `exc` that only says a connection was lost is a symptom: wait up to `timeout_s` for
        the watchdog to name the peer that went silent (the default `on_dead` then exits this
        process); only if none does is `exc` reported as this rank's own failure. A peer that
        had finished its script (checked out through the store) explains it at once: this rank
        was still in a collective that peer never entered.
        """
        said = describe_error(exc)
        if not self._threads:
            return said
        if is_connection_lost(exc):
            if finished := self._finished_peers():
                said = uneven_hint(finished) + said
            else:
                self._suspect = True
                # The default on_dead exits this process (never returns); a custom one returns.
                if self._fired.wait(self.timeout_s + self.interval_s):
                    self._handled.wait(self.timeout_s)
                    return said
        self._publish(PeerFailure("failed", self.rank, f"at step {self._step}: {said}"))
        return said

    def _finished_peers(self) -> list[int]:
        """The peers that checked out as done (their script ended; `stop(done=True)`)."""
        try:
            return [r for r in self._peers if self._store.check([f"done/{r}"])]
        except RuntimeError:  # the store went with its host: nothing to tell from here
            return []

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.report_failure(exc)
        self.stop(done=exc is None)

    # -- threads --------------------------------------------------------------------------

    def _hook(self, exc_type, exc, tb) -> None:
        said = self.report_failure(exc)
        # The launcher's report then names the exception, not "exit code 1"; the traceback is
        # the one the hook below prints, at the end of this rank's output (not printed twice).
        write_error_file(said, replace=False)
        # Every rank raising the same error (a model's mistake) prints it once between them.
        print_once(self._store, self.rank, exc, said,
                   lambda: (self._previous_hook or sys.__excepthook__)(exc_type, exc, tb))

    def _beat_loop(self) -> None:
        while not self._stop.is_set() and not self._fired.is_set():
            try:
                self._beat_once()
                self._last_ok = time.monotonic()
                self._store_error = ""
            except RuntimeError as e:  # the store is unreachable; the check thread times it
                self._store_error = describe_error(e)
                if is_connection_lost(e):  # closed for good (its process is gone): stop asking,
                    self._store_gone_at = time.monotonic()  # each failed op logs a C++ stack
                    return
            self._stop.wait(self.interval_s)

    def _beat_once(self) -> None:
        store = self._store
        store.add(f"hb/{self.rank}", 1)
        step = self._step
        if step != self._published_step:  # add() never blocks on a missing key, unlike get()
            store.add(f"step/{self.rank}", step - self._published_step)
            self._published_step = step
        # Never backwards: a script that destroyed its groups has issued what it issued.
        issued = max(collective_progress(self.world_size), self._published_count)
        if issued != self._published_count:
            store.add(f"issued/{self.rank}", issued - self._published_count)
            self._published_count = issued
        now = time.monotonic()
        self._hangs.observe(self.rank, issued, now)
        for r in tuple(self._watched):
            count = store.add(f"hb/{r}", 0)
            if count != self._seen[r]:
                self._seen[r], self._last_change[r] = count, now
            elif store.check([f"done/{r}"]):
                self._watched.discard(r)
                self._hangs.forget(r)
                continue
            else:
                self._last_step[r] = store.add(f"step/{r}", 0)
            self._hangs.observe(r, store.add(f"issued/{r}", 0), now)
        if self._found is None and store.add("nfailed", 0) > 0:
            for r in self._peers:
                if r not in self._departed and store.check([f"failed/{r}"]):
                    kind, _, reason = (store.get(f"failed/{r}").decode(errors="replace")
                                       .partition("|"))
                    self._found = PeerFailure(kind, r, reason)
                    break

    def _check_loop(self) -> None:
        period = min(max(self.interval_s / 4, 0.05), 0.5)
        while not self._stop.wait(period):
            failure = self._check_once(time.monotonic())
            if failure is None:
                continue
            if failure.kind != "store" and failure.rank in self.tolerate:
                self._depart(failure)
                continue
            self._fire(failure, found_here=failure is not self._found)
            return

    def _check_once(self, now: float) -> PeerFailure | None:
        if self._found is not None:
            return self._found
        limit = self.suspect_timeout_s if self._suspect else self.timeout_s
        silent = now - self._last_ok
        # A closed connection is final, but give stop() at the end of a job a moment to win.
        gone = self._store_gone_at is not None and now - self._store_gone_at > 2 * self.interval_s
        if gone or silent > limit:
            owner = ("the launcher on the rendezvous host" if self._store_owner is None
                     else f"rank {self._store_owner}'s process")
            return PeerFailure("store", self._store_owner, (
                f"lost the rendezvous store at {self._store_addr} (run by {owner}) for "
                f"{silent:.1f} s: {self._store_error or 'no reply'}; "
                "that process or its host died"))

        # Silence is measured up to the last good round, so a store outage is not blamed on peers.
        for r in tuple(self._watched):
            age = self._last_ok - self._last_change[r]
            if age > limit:
                return PeerFailure("died", r, f"no heartbeat for {age:.1f} s; last step "
                                              f"{self._last_step[r]}")
        hang = self._hangs.hang([self.rank, *self._watched], self._last_ok)
        if hang is None:
            return None
        if self.rank in hang.behind:  # this rank is the cause: it says so itself, with its stack
            return PeerFailure("hung", self.rank, hang.reason())
        # The rank behind reports itself (with its stack); name it here only if it cannot.
        if hang.stuck_s > self.timeout_s + 3 * self.interval_s:
            return PeerFailure("hung", hang.behind[0], hang.reason())
        return None
