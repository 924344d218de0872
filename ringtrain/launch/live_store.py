"""A live agent's line to the job's store: lost members' pids, its node's beat, the store's silence.

    watch = StoreWatch()
    watch.start(context.envs)       # once the workers run: a thread polls the store
    watch.pids()                    # pids of this node's members the live group declared lost
    watch.mark(pid)                 # `departed/{uid}` for this node's process `pid`, which exited
    watch.silent_s()                # how long the store has not answered
    watch.finish(bound_s)           # this node is done: wait for the other nodes' agents

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
  the store that long), or is dead.
"""

from __future__ import annotations

import contextlib
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
        # node -> (beat, when it last moved on our clock, done, left)
        self._others: dict[int, tuple[int, float, bool, bool]] = {}
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

    def _wait_for(self, bound_s: float, phase: int, ignore) -> list[int]:
        """Until every other agent but `ignore` is past `phase` (1 done, 2 left) or silent."""
        self._wake.set()
        while True:
            now = time.monotonic()
            if now - self._contact > bound_s or (phase == 2 and self._host_gone):
                return sorted(set(range(self.nodes)) - {self.node})
            with self._lock:
                others = dict(self._others)
            waiting = [n for n in range(self.nodes) if n != self.node and n not in ignore
                       and not (n in others and others[n][1 + phase])]
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
            done, left = (store.check([f"agents/{n}/{_PHASES[p]}"]) for p in (1, 2))
            with self._lock:
                last = self._others.get(n)
                moved = now if last is None or last[0] != beat else last[1]
                self._others[n] = (beat, moved, done, left)
