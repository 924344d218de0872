"""A live agent's line to the job's store: lost members' pids, its node's beat, the store's silence.

    watch = StoreWatch()
    watch.start(context.envs)       # once the workers run: a thread polls the store
    watch.pids()                    # pids of this node's members the live group declared lost
    watch.mark(pid)                 # `departed/{uid}` for this node's process `pid`, which exited
    watch.silent_s()                # how long the store has not answered
    watch.finish(bound_s)           # this node is done: wait for the other nodes' agents
    watch.fail(record, bound_s)     # this node's worker failed: say so to every node, first wins
    watch.failure()                 # another node's failure record, once one is in the store

`ringtrain.launch.live_agent` asks it from torch's agent poll. Every store call runs on the
thread, never on the agent's own: across nodes the store is node 0's agent, and a call to a host
whose link is down blocks for the client's timeout, while the agent must go on watching (and,
past `STORE_SILENT_S`, stopping) its workers.

Across nodes (`ringtrain train --live --nnodes N`):
- a pid means a process only on its own machine, so a member is this node's when its launcher
  rank (`slot/{uid}`, written by `LiveGroup`) is one of this node's ranks: another node's
  member with the same pid is never killed or marked here;
- each agent beats `agents/{node}/beat` in the store, and says `agents/{node}/done` once its
  workers are done (then `left`, see `finish`). torch's exit barrier waits for every node's
  agent (300 s) and would hold a finished job that long after a node was lost; `finish` waits
  only for agents that still beat: one silent for `STORE_SILENT_S` has stopped itself (it lost
  the store that long), or is dead;
- a worker failure that is the job's (an exception: the same bug on any replacement) is every
  node's: the agent that sees it writes `failed` (JSON: node, host, rank, pid, exit code, error
  line) with compare-and-set, so the first failure wins, and waits until every other agent that
  still beats has read it (`agents/{node}/seen_failed`) before it stops its own workers: the
  store's host would take the store with it, and the others would then lose a second to
  regrouping and ten to the store's silence. Every other agent's `failure()` then returns it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["STORE_SILENT_S", "StoreWatch"]

# Where `LiveGroup(name="train")` keeps its keys under the worker's store prefix
# (`ringtrain.launch.process_group._agent_store`, `ringtrain.live.group`).
_LIVE_KEYS = "ringtrain/{run}/attempt_{attempt}/ringtrain/live/train"
_POLL_S = 0.25
# An agent whose store has not answered this long stops its node (live_agent): its members were
# left out of the job after about a second (`dead_after_s`), a replacement could not reach the
# store, and the other nodes' agents stop waiting for it. Ten seconds is far past any pause of
# a working link, and short enough that a cut-off node is gone before anyone looks for it.
STORE_SILENT_S = 10.0
_ERRORS = (RuntimeError, OSError, KeyError, ValueError)
_PHASES = {1: "done", 2: "left"}  # `finish`'s two rounds, as written in the store
_SEEN_FAILED = "seen_failed"  # `agents/{node}/seen_failed`: it read another node's `failed`
# How long a failed node's agent waits for the others to read its record before it stops its
# workers anyway: each reads it within a poll (`_POLL_S`); one that has not in this long is
# cut off, and learns the job is over from its store's silence or its members' absence.
FAILURE_SEEN_S = 5.0


class StoreWatch:
    """The store as one node's live agent sees it (see the module docstring)."""

    def __init__(self, poll_s: float = _POLL_S, silent_after_s: float = STORE_SILENT_S):
        self.poll_s, self.silent_after_s = poll_s, silent_after_s
        self.ranks: frozenset[int] = frozenset()  # this node's launcher ranks
        self.node, self.nodes = 0, 1
        self.endpoint = ""
        self._store: Any = None
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._found: list[int] = []  # departed pids not yet handed out
        self._to_mark: list[int] = []
        self._members: list[tuple[int, int]] = []  # uid -> (slot, pid), as registered
        self._phase = self._written = 0  # of `finish`: 1 done, 2 left; the one said in the store
        self._host_gone = False  # the store stopped answering once this agent said `left`
        # node -> (beat, when it last moved on our clock, done, left, seen_failed)
        self._others: dict[int, tuple[int, float, bool, bool, bool]] = {}
        self._failing: str | None = None  # this node's failure record, to write (`fail`)
        self._failed: dict | None = None  # the job's failure record, once read (any node's)
        self._failure_told = False  # another node's record, handed out by `failure()`
        self._contact = self._contact_began = time.monotonic()  # the last whole poll: end, start
        self._asked: dict[int, float] = {}  # pid -> when `answered_since` first saw it
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, envs: dict[int, dict[str, str]]) -> None:
        """Start polling, with the workers' environments (`SubprocessContext.envs`)."""
        env = next(iter(envs.values()), {})
        if self._thread is not None or "MASTER_PORT" not in env:  # no store: nothing to watch
            return
        self.ranks = frozenset(int(e.get("RANK", -1)) for e in envs.values())
        self.node, self.nodes = int(env.get("GROUP_RANK", 0)), int(env.get("GROUP_WORLD_SIZE", 1))
        self.endpoint = f"{env.get('MASTER_ADDR', 'localhost')}:{env['MASTER_PORT']}"
        self._contact = self._contact_began = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(env,), daemon=True,
                                        name="ringtrain-live-store")
        self._thread.start()

    def close(self) -> None:
        """Stop polling. A poll takes milliseconds; one blocked on a store whose host is
        unreachable would block for minutes and is left behind (a daemon thread)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def silent_s(self) -> float:
        """Seconds since the store last answered a whole poll (0 before `start`)."""
        return 0.0 if self._thread is None else time.monotonic() - self._contact

    def answered_since(self, pids: list[int]) -> bool:
        """Whether a whole poll of the store began after each of `pids` was first asked about
        (exited workers): until then, asks for one at once and says False."""
        now = time.monotonic()
        seen = [self._asked.setdefault(pid, now) for pid in pids]
        if not seen or self._thread is None or self._contact_began > max(seen):
            return True
        self._wake.set()
        return False

    def pids(self) -> list[int]:
        """Pids of this node's members that the live group declared lost, each once."""
        with self._lock:
            out, self._found = self._found, []
        return out

    def mark(self, pid: int) -> None:
        """Have `departed/{uid}` written for this node's process `pid`, which exited: its peers
        regroup without waiting out its heartbeat (`dead_after_s`), no generation takes it in."""
        with self._lock:
            self._to_mark.append(pid)
        self._wake.set()

    def finish(self, bound_s: float | None = None) -> list[int]:
        """Say this node is done; wait until every other node's agent is done too, or silent
        for `bound_s` (default `silent_after_s`). Returns the nodes given up on.

        Two rounds, as the store's host must be the last to go: each agent says `done` and
        waits for the others' (or their silence), then says `left` and waits for the others'
        `left`; an agent whose store stops answering once it said `left` is done waiting (the
        host, the only one that may not miss a `left`, has gone).
        """
        if self._thread is None:  # no worker ever ran here
            return []
        bound_s = self.silent_after_s if bound_s is None else bound_s
        self._phase = 1
        gone = self._wait_for(bound_s, phase=1, ignore=())
        self._phase = 2
        self._wait_for(bound_s, phase=2, ignore=gone)
        return gone

    def fail(self, record: dict, bound_s: float = FAILURE_SEEN_S) -> dict | None:
        """Write `record` as the job's failure unless another node's came first; wait until
        every other agent that still beats has read it, up to `bound_s`. Returns the record
        that won (this one, or another node's: the job's failure either way), or None if the
        store did not answer in `bound_s`."""
        if self._thread is None:  # one node without a store: torch's stop is the job's
            return None
        self._failing = json.dumps({**record, "node": self.node})
        self._wake.set()
        deadline = time.monotonic() + bound_s
        while self._failed is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_s / 5)
        # Ours: every agent that beats has read it, or bound_s. Another node's (it failed first):
        # its agent waits for the readers.
        while self._failed["node"] == self.node and time.monotonic() < deadline:
            now = time.monotonic()
            with self._lock:
                others = dict(self._others)
            if all(n in others and (others[n][4] or now - others[n][1] > bound_s)
                   for n in range(self.nodes) if n != self.node):
                break
            time.sleep(self.poll_s / 5)
        return self._failed

    def failure(self) -> dict | None:
        """Another node's failure record (`fail`), once: the job is over."""
        record = self._failed
        if record is None or self._failure_told or record["node"] == self.node:
            return None
        self._failure_told = True
        return record

    def _wait_for(self, bound_s: float, phase: int, ignore) -> list[int]:
        """Until every other agent but `ignore` is past `phase` (1 done, 2 left) or silent; a
        node whose worker failed (`fail`) is never done, and its agent leaves on its own."""
        self._wake.set()
        while True:
            now = time.monotonic()
            if now - self._contact > bound_s or (phase == 2 and self._host_gone):
                return sorted(set(range(self.nodes)) - {self.node})
            with self._lock:
                others = dict(self._others)
            failed = self._failed["node"] if self._failed is not None else None
            waiting = [n for n in range(self.nodes) if n not in (self.node, failed)
                       and n not in ignore and not (n in others and others[n][1 + phase])]
            gone = [n for n in waiting if n in others and now - others[n][1] > bound_s]
            if len(gone) == len(waiting) and self._written >= phase:
                return gone
            time.sleep(self.poll_s)

    # -- the thread -------------------------------------------------------------------------
    def _run(self, env: dict[str, str]) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            with contextlib.suppress(*_ERRORS):
                if self._store is None:  # the agent's own store, as a client (the workers' address)
                    client = dist.TCPStore(self.endpoint.rpartition(":")[0],
                                           int(env["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=5))
                    self._store = dist.PrefixStore(_LIVE_KEYS.format(
                        run=env.get("TORCHELASTIC_RUN_ID", "none"),
                        attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0")), client)
                try:
                    self._poll(self._store)
                except _ERRORS:
                    self._host_gone = self._written == 2  # it goes last (`finish`)
                    raise
                self._contact, self._contact_began = time.monotonic(), began
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _poll(self, store: Any) -> None:
        self._poll_failure(store)
        with self._lock:
            to_mark, self._to_mark = self._to_mark, []
        for uid in range(len(self._members), int(store.add("uids", 0))):
            if not store.check([f"slot/{uid}", f"pid/{uid}"]):
                break  # registering now: read it whole next time
            self._members.append((int(store.get(f"slot/{uid}")), int(store.get(f"pid/{uid}"))))
        mine = {uid: pid for uid, (slot, pid) in enumerate(self._members) if slot in self.ranks}
        for uid, pid in mine.items():
            if pid in to_mark:
                store.set(f"departed/{uid}", b"1")
                self._seen.add(uid)
            elif uid not in self._seen and store.check([f"departed/{uid}"]):
                self._seen.add(uid)
                with self._lock:
                    self._found.append(pid)
        store.add(f"agents/{self.node}/beat", 1)
        phase = self._phase
        for p in range(self._written + 1, phase + 1):
            store.set(f"agents/{self.node}/{_PHASES[p]}", b"1")
        self._written = max(self._written, phase)
        now = time.monotonic()
        for n in range(self.nodes):
            if n == self.node:
                continue
            beat = int(store.add(f"agents/{n}/beat", 0))
            said = (store.check([f"agents/{n}/{key}"]) for key in (*_PHASES.values(),
                                                                   _SEEN_FAILED))
            with self._lock:
                last = self._others.get(n)
                moved = now if last is None or last[0] != beat else last[1]
                self._others[n] = (beat, moved, *said)

    def _poll_failure(self, store: Any) -> None:
        """Write this node's failure record (the first one wins), or read another's; say it was
        read. First in the poll: the other nodes stop as soon as the store knows."""
        if self._failed is not None:
            return
        if self._failing is not None:
            # Sets the key where it is absent; returns what it holds now, ours or the first's.
            value = store.compare_set("failed", "", self._failing)
        elif store.check(["failed"]):
            value = store.get("failed")
        else:
            return
        record = json.loads(value)
        if record["node"] != self.node:
            store.set(f"agents/{self.node}/{_SEEN_FAILED}", b"1")
        self._failed = record
