"""`LiveGroup`: who trains now, agreed through the store, one fresh gloo group per generation.

    group = LiveGroup(store, world_size=3, timeout_s=30)   # store hosted outside the members
    group.join(state)                 # a member of generation 0, or a replacement that heals
    ... step over group.process_group (group.rank of group.size) ...
    group.recover(state, error)       # a collective failed: agree on who is left, go on
    group.admit(state)                # at a step boundary: let waiting replacements in

torchft's quorum, smaller. Every process that runs the job function registers in the store and
gets a `uid` (a counter, never reused) and a heartbeat thread. A *generation* is a list of
uids, its members in rank order; the first `world_size` uids form generation 0 (in launcher
`slot` order where given), later ones wait as replacements (`joining.py`: how a process becomes
a member). Generation g's process group is a gloo group built directly on
`PrefixStore(f"gen{g}/pg", store)`: the default group is never destroyed or re-initialised (a
dead peer's group cannot be torn down collectively), and a new prefix means no key of an older
generation is ever read again.

Forming generation g+1 after a failure (every member of g that is still running, together):
- each writes `gen{g+1}/here/{uid}`; a member of g is *lost* once its heartbeat has not moved
  for `dead_after_s` (a SIGKILL, a SIGSTOP, a lost host), once `departed/{uid}` is written (the
  launcher's agent saw its process exit: a kill costs a poll, not `dead_after_s`), or when it
  has not arrived within `timeout_s + dead_after_s` (alive but stuck: the bound on waiting);
- once every member of g is here or lost, one of them proposes the member list and writes it
  with compare-and-set: the first proposal is the generation, for everyone. Survivors keep
  their ranks; a waiting replacement takes a lost member's rank, so with the world size
  restored each rank trains the fault-free run's share and the sums keep their order;
  without one the survivors close ranks.
Every member's heartbeat thread (`Heartbeats`, heartbeats.py) also reads the other members'
counters, so a decision knows how long each has been silent, and so does a collective in
flight: the group handed out is a `WatchedGroup` (watched.py), whose waits raise
`LiveMemberSilentError` once a member has been silent for `dead_after_s`. A SIGKILL (gloo
raises at once), a SIGSTOP and a lost link are all found after about `dead_after_s` (1 s by
default), not after the collective timeout; a member that is merely slow still beats (its
thread does), so only `timeout_s` bounds waiting for it.
Building a generation's group is watched the same way (`_connect`): a replacement lost while
the group forms (its host's link just went down) costs a second, not the group's timeout.

.. warning:: The store must outlive every member: host it in the agent, the launcher or a
    separate process (tests host it in the parent). If the store's host dies, the job is lost
    (a whole-job restart from the last snapshot).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtrain.live.heal import HealReport, heal
from ringtrain.live.heartbeats import Heartbeats, clone_store
from ringtrain.live.joining import generation0_members, register, wait_for, wait_to_be_let_in
from ringtrain.live.roster import decode, encode, first_departed, propose, waiting_uids
from ringtrain.live.state import LiveState
from ringtrain.live.watched import LiveMemberSilentError, RetiredGroups, WatchedGroup
from ringtrain.store_keys import claim_key


class LiveMemberLostError(RuntimeError):
    """This process was declared lost by the others (silent too long): it cannot go on."""


class LiveRecoveryError(RuntimeError):
    """A collective failed but no member was lost: the error is this job's own, not a fault."""


class LiveGroup:
    """This process's view of the job's generations; its current one's process group.

    Args:
        store: the job's store, reachable by every process and hosted outside them.
        world_size: how many members the job trains with when whole.
        name: names the store keys, the same in every process of the job.
        timeout_s: each generation's collective timeout: the bound on waiting for a member
            that still beats but does not take part (stuck), and on building a group.
        heartbeat_s: how often this process beats in the store (from a thread).
        dead_after_s: a member silent this long is lost, also inside a collective (several
            heartbeats, so a busy host is not taken for a dead one).
        join_timeout_s: how long a replacement waits to be let in.
        retries: failed steps in a row, at one step, that lost no member and are redone
            before `recover` raises (a live but slow peer can time a collective out).
        replace_wait_s: after losing members, how long the survivors wait for as many
            replacements to register before going on without them (0: go on at once; a
            replacement then joins at a later step boundary). Waiting keeps every step's
            world size, so the run ends with the fault-free sums, for a stall of about a
            replacement's start-up (`ringtrain train --live-wait`).
        spare: a warm spare, started before any fault (`ringtrain train --live-spares`): it
            registers once generation 0 has formed (so it never takes a place in it) and waits
            to be let in for as long as the job runs, not `join_timeout_s`.
        slot: this process's launcher RANK: generation 0's ranks follow it (None: the uid).
        stop_requested: True once this process was asked to stop (SIGTERM: the job is being
            stopped): the survivors stop waiting for replacements and go on without them, so
            the step ends and the loop's stop vote runs (else the wait outlasts the agent's
            shutdown timeout, and the process is SIGKILLed without its snapshot).
    """

    def __init__(self, store: dist.Store, world_size: int, *, name: str = "live",
                 timeout_s: float = 30.0, heartbeat_s: float = 0.1, dead_after_s: float = 1.0,
                 join_timeout_s: float = 600.0, retries: int = 1, replace_wait_s: float = 0.0,
                 spare: bool = False, stop_requested: Callable[[], bool] = lambda: False,
                 slot: int | None = None):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: it must be at least 1")
        if not 0 < heartbeat_s < dead_after_s:
            raise ValueError(f"heartbeat_s={heartbeat_s}, dead_after_s={dead_after_s}: need "
                             "0 < heartbeat_s < dead_after_s (e.g. 0.5 and 5)")
        prefix = f"ringtrain/live/{name}"
        claim_key(store, prefix, 0, "LiveGroup", name)  # one per process and name
        self._store = dist.PrefixStore(prefix, store)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.join_timeout_s, self.retries = join_timeout_s, retries
        self.replace_wait_s = replace_wait_s
        self._fruitless = (-1, 0)  # (step, recoveries in a row there that lost no member)
        self.spare, self.stop_requested = spare, stop_requested
        if spare:  # a uid below world_size would be a place in generation 0: take one after
            wait_for(self._store, "gen0/members", "generation 0 to form", join_timeout_s)
        # Before the first beat (joining.py says why).
        self.uid, self._first_generation = register(self._store, slot)
        self._beats = Heartbeats(self._store, dist.PrefixStore(prefix, clone_store(store)),
                                 self.uid, heartbeat_s=heartbeat_s, dead_after_s=dead_after_s,
                                 members=lambda: self.members, known=lambda: self._known)
        # Beaten once, from here on it may be let in: generation 0's processes now, any later
        # one in `join`, once it has made what its heal receives into (`prepare_heal`): the
        # members would otherwise wait for it inside their step boundary.
        self._beating = self.uid < world_size
        if self._beating:
            self._beats.beat_once()
        self.generation = -1
        self.members: list[int] = []
        self.process_group: WatchedGroup | None = None
        self.last_heal: HealReport | None = None
        self._known: set[int] = set()  # uids seen in a generation or found departed
        self._retired = RetiredGroups()
        self._departed_read_at = 0.0  # when `check_members` last read the members' departed/
        if self._beating:
            self._beats.start()

    # -- where this process stands ----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.members.index(self.uid)

    @property
    def size(self) -> int:
        return len(self.members)

    def check_members(self) -> None:
        """Raise `LiveMemberSilentError` if a member's heartbeat has not moved for
        `dead_after_s`, as last read by this process's heartbeat thread, or if one is
        departed (`first_departed`, read at most every `heartbeat_s`).

        Silence is counted up to that thread's last read, not up to now: if this process's own
        thread is starved (a loaded host) or its store link is down, nobody is accused; and a
        wait of the store itself is nobody's silence (`Heartbeats.excuse`).
        """
        found = self._beats.silent()
        if found is not None:
            u, silent = found
            raise LiveMemberSilentError(
                f"member uid {u} of generation {self.generation} has not beaten for "
                f"{silent:.2f} s (dead_after_s={self.dead_after_s:g}): lost or "
                "frozen; this collective is abandoned and the survivors regroup")
        if time.monotonic() < self._departed_read_at + self.heartbeat_s:
            return
        self._departed_read_at = time.monotonic()
        u = first_departed(self._store, self.members, self.uid)
        if u is not None:
            raise LiveMemberSilentError(
                f"member uid {u} of generation {self.generation} departed (its agent saw its "
                "process exit, or the others left it out): this collective is abandoned and "
                "the survivors regroup")

    # -- joining (joining.py: the waits before a process is a member) -----------------------
    def join(self, state: LiveState) -> bool:
        """Become a member (generation 0, or a later one as a replacement) and heal.

        Returns False if the job finished before this process was let in. Generation 0 starts
        from its rank 0's state (as DDP's broadcast at construction); a replacement takes the
        newest committed state of the members (`heal`). A replacement first makes the memory its
        heal receives into (`LiveState.prepare_heal`), then beats: it is let in once ready.
        """
        if self.uid < self.world_size:  # the first world_size processes: generation 0
            members = generation0_members(self._store, self.world_size, self.join_timeout_s)
            self._enter(0, members, state, fresh=members.index(self.uid) != 0)
            return True
        if not self._beating:  # a replacement or a spare: it heals, once let in
            state.prepare_heal()
            self._beating = True
            self._beats.beat_once()
            self._beats.start()
        found = wait_to_be_let_in(self._store, self._beats, self.uid, self._first_generation,
                                  spare=self.spare, timeout_s=self.join_timeout_s,
                                  heartbeat_s=self.heartbeat_s, dead_after_s=self.dead_after_s)
        if found is None:
            return False
        try:
            self._enter(*found, state, fresh=True)
        except RuntimeError:  # a member was lost while it formed: the next one
            # This process is a member of that generation now: the others wait for it to
            # arrive in the next one (else for `timeout_s`), so it forms that one with them.
            self._reform(state, fresh=True)
        return True

    def admit(self, state: LiveState) -> bool:
        """At a step boundary, on every member: let waiting replacements in while short.

        One store read and, while the group is short of `world_size`, one 1-element
        all-reduce (the members must agree on the step at which the generation changes).
        After letting someone in, the new generation asks again, still short: a replacement
        starts its first step with this call, so the members it joined must make it too
        (else its 8-byte all-reduce meets their gradients': gloo aborts the process).
        """
        admitted = False
        while self.size < self.world_size:
            flag = torch.tensor([1 if self._waiting() else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            if not int(flag):
                break
            self._reform(state)
            admitted = True
        return admitted

    # -- failures ---------------------------------------------------------------------------
    def recover(self, state: LiveState, error: BaseException) -> None:
        """After a failed collective: form the next generation, restore, heal; go on.

        A recovery that finds every member still there redoes the step too (a collective that
        timed out on a live but slow peer), up to `retries` times in a row at one step; then
        it raises `LiveRecoveryError` from `error`: not a lost member, and redoing the step
        fails the same way. Every member counts the same recoveries, so all decide alike.
        """
        old = list(self.members)
        state.restore()
        self._reform(state)
        if not set(old) <= set(self.members):
            self._fruitless = (state.step, 0)
            return
        step, count = self._fruitless
        self._fruitless = (state.step, count + 1 if step == state.step else 1)
        if self._fruitless[1] > self.retries:
            raise LiveRecoveryError(
                f"step {state.step} failed on uid {self.uid} {self._fruitless[1]} times in a row "
                f"(generation {self.generation}) but every member ({old}) is still in the job: "
                f"not a lost peer, so redoing it will not help. The error: {error}") from error

    def close(self) -> None:
        """Stop beating; tell waiting replacements the job is done (they return False)."""
        if self.process_group is not None:
            self._store.set("finished", b"1")
        self.process_group = None
        if self._beating:
            self._beats.stop()

    # -- generations ------------------------------------------------------------------------
    def _reform(self, state: LiveState, *, fresh: bool = False) -> None:
        # fresh: no committed state yet (a replacement whose first generation failed to form)
        old, g = list(self.members), self.generation + 1
        if self.process_group is not None:
            # Released once idle (`RetiredGroups`): kept, a broken group spins gloo's loop.
            self._retired.add(self.process_group)
        self.process_group = None
        while True:
            self._store.set(f"gen{g}/here/{self.uid}", b"1")
            members = self._decide(g, old)
            if self.uid not in members:
                raise LiveMemberLostError(
                    f"uid {self.uid} (pid {os.getpid()}) was left out of generation {g} "
                    f"({members}): the others found it silent for over {self.dead_after_s:g} s "
                    "or late by over the join bound; restart it as a replacement")
            try:
                self._enter(g, members, state, fresh=fresh)
                return
            except RuntimeError:  # a member died while the group formed: one more generation
                old, g = members, g + 1

    def _enter(self, g: int, members: list[int], state: LiveState, *, fresh: bool) -> None:
        self.generation, self.members = g, members
        self._known.update(members)
        self.process_group = WatchedGroup(self._connect(g), self.check_members)
        self.last_heal = heal(state, self.process_group, self.rank,
                              committed_step=-1 if fresh else None)

    def _connect(self, g: int) -> dist.ProcessGroup:
        """Generation g's gloo group, built while its members' heartbeats are watched.

        Building it connects to every member and blocks until they all have, up to
        `timeout_s`: a member lost meanwhile (a replacement on a host whose link just went
        down) would cost the whole timeout. The build runs in a thread (it releases the GIL)
        and is abandoned, still blocked, once `check_members` finds a member silent.
        It reads the store over a connection of its own: an abandoned build stays blocked in a
        store wait for the lost member's address until `timeout_s`, and a TCP store client
        runs one request at a time, so on the shared connection every store call forming the
        next generation would queue behind it (a lost link cost 30 s, issue 26).
        """
        built: dict[str, object] = {}
        # Read now: an abandoned build outlives this call, and `members` moves on.
        rank, size = self.rank, self.size
        store = dist.PrefixStore(f"gen{g}/pg", clone_store(self._store))

        def build() -> None:
            try:
                built["group"] = dist.ProcessGroupGloo(
                    store, rank, size, timedelta(seconds=self.timeout_s))
            except RuntimeError as error:
                built["error"] = error

        thread = threading.Thread(target=build, daemon=True, name=f"ringtrain-live-gen{g}")
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive():
                self.check_members()
        if "error" in built:
            raise built["error"]  # type: ignore[misc]
        return built["group"]  # type: ignore[return-value]

    def _decide(self, g: int, old: list[int]) -> list[int]:
        """Generation g's members: the first proposal written, whoever wrote it."""
        key = f"gen{g}/members"
        bound = time.monotonic() + self.timeout_s + self.dead_after_s
        while not self._store.check([key]):
            here, lost, pending = [], [], []
            for u in old:
                if self._store.check([f"gen{g}/here/{u}"]):
                    here.append(u)
                    continue
                _, silent = self._beats.read(self._store, u)
                late = time.monotonic() > bound
                # departed: the agent saw its process die (or another member decided): lost
                # now, not a heartbeat bound later
                gone = silent > self.dead_after_s or late or \
                    self._store.check([f"departed/{u}"])
                (lost if gone else pending).append(u)
            if not pending:
                for u in lost:
                    self._store.set(f"departed/{u}", b"1")
                self._await_replacements(key, len(lost))
                proposal = propose(old, here, waiting_uids(self._store, self._beats,
                                                           self._known), self.world_size)
                value = encode(proposal).encode()
                if self._store.compare_set(key, "", value) == value and \
                        self._store.add(f"gen{g}/counted", 1) == 1:
                    # Once per generation: members proposing the same list all see it win.
                    self._store.add("generations", 1)  # replacements look from here on
                break
            time.sleep(0.01)
        members = decode(self._store.get(key))
        self._known.update(u for u in old if u not in members)
        return members

    def _await_replacements(self, key: str, lost: int) -> None:
        """Wait up to `replace_wait_s` for `lost` replacements (or another member's proposal).

        `departed/{uid}` is written first: a launcher that watches it kills a hung member and
        starts its replacement, which this wait then lets in. A stop requested ends it.
        """
        deadline = time.monotonic() + self.replace_wait_s
        while lost and time.monotonic() < deadline and not self._store.check([key]) and \
                not self.stop_requested():
            if len(waiting_uids(self._store, self._beats, self._known)) >= lost:
                return
            time.sleep(0.05)

    def _waiting(self) -> bool:
        return bool(waiting_uids(self._store, self._beats, self._known))
