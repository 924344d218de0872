"""Who is in a live job, as the store says: the processes waiting to be let in, the members
gone, and the member list a new generation proposes (`LiveGroup`, group.py, asks these).

Keys, under the live group's prefix: `uids` (a counter: each process's uid), `hb/{uid}` (its
heartbeat counter, `Heartbeats`), `slot/{uid}` (its launcher rank, or uid), `departed/{uid}`
(found lost, by the members or by the agent that saw its process exit), `gen{g}/members`
(generation g's uids in rank order, written once, `encode`d).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ringtrain.live.heartbeats import Heartbeats


def encode(uids) -> str:
    return ",".join(str(u) for u in uids)


def decode(value: bytes | str) -> list[int]:
    text = value.decode() if isinstance(value, bytes) else value
    return [int(u) for u in text.split(",") if u]


def generation0(store: dist.Store, world_size: int, timeout_s: float) -> list[int]:
    """Generation 0's uids in rank order: by each one's launcher slot (`slot/{uid}`, written at
    registration, its uid where none was given), so the launcher's rank 0 is the members'."""
    uids = list(range(world_size))
    store.wait([f"slot/{u}" for u in uids], timedelta(seconds=timeout_s))
    slots = {u: int(store.get(f"slot/{u}")) for u in uids}
    return sorted(uids, key=lambda u: (slots[u], u))


def propose(old: list[int], here: list[int], waiting: list[int], world_size: int) -> list[int]:
    """The next generation's members: the members of `old` that are `here` keep their ranks, a
    `waiting` process takes a lost member's rank (with the world size restored each rank trains
    the fault-free run's share and the sums keep their order), more join at the end up to
    `world_size`; without replacements the survivors close ranks."""
    waiting = list(waiting)
    slots: list[int | None] = [u if u in here else None for u in old]
    for i, u in enumerate(slots):
        if u is None and waiting:
            slots[i] = waiting.pop(0)
    members = [u for u in slots if u is not None]
    while waiting and len(members) < world_size:
        members.append(waiting.pop(0))
    return members


def waiting_uids(store: dist.Store, beats: Heartbeats, known: set[int]) -> list[int]:
    """Registered processes never in a generation (not in `known`), not departed, beating now
    (a spare whose heartbeat stopped, e.g. on a host that lost its link, is not let in).
    Departed ones are added to `known`."""
    out = []
    for u in range(int(store.add("uids", 0))):
        if u in known:
            continue
        if store.check([f"departed/{u}"]):
            known.add(u)
            continue
        count, silent = beats.read(store, u)
        if count > 0 and silent <= beats.dead_after_s:
            out.append(u)
    return out


def all_gone(store: dist.Store, beats: Heartbeats, members: list[int]) -> bool:
    """Whether every one of `members` is departed or silent for over `dead_after_s` (every
    counter is read each call: silence is timed across calls)."""
    gone = [store.check([f"departed/{u}"]) or
            beats.read(store, u)[1] > beats.dead_after_s for u in members]
    return all(gone)


def first_departed(store: dist.Store, members: list[int], uid: int) -> int | None:
    """The first of `members` (other than `uid`) marked `departed/{uid}`, else None.

    A departed member is lost at once, also inside a collective: a SIGKILL fails it at once
    only where a connection to the dead process is in use, and a survivor waiting on a live
    peer would wait out `dead_after_s` while the others regroup without it (0.7 s of a kill's
    2 s stall in benchmarks/live_recovery.py)."""
    return next((u for u in members if u != uid and store.check([f"departed/{u}"])), None)
