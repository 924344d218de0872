"""How a process becomes a member of a live job: it registers, then waits for its generation.

    uid, first = register(store, slot)              # before its first heartbeat
    members = generation0_members(store, world_size, timeout_s)     # uid < world_size
    found = wait_to_be_let_in(store, beats, uid, first, spare=False, ...)  # a replacement
    ... `LiveGroup.join` then enters the generation found and heals ...

Apart from the generations (`group.py`: forming the next one after a fault, letting waiting
processes in at a step boundary) because these are the waits before a process is a member at
all: the first `world_size` processes agree on generation 0 once all have registered; any
later one (a replacement, or a warm spare started with the job) polls the store until a
generation lists its uid, the job finishes, or nobody is left to let it in
(`LiveJobLostError`). A spare waits for as long as the job runs; a replacement up to
`join_timeout_s`. Every function reads and writes the job's store under `LiveGroup`'s prefix.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from ringtrain.live.heartbeats import Heartbeats
from ringtrain.live.roster import all_gone, decode, encode, generation0

__all__ = ["LiveJobLostError", "generation0_members", "raise_if_all_gone", "register",
           "wait_for", "wait_to_be_let_in"]


class LiveJobLostError(RuntimeError):
    """Every member of the last generation is gone: nobody is left to let a replacement in or
    to heal it from, so the job fails and restarts from its last snapshot (the restart path)."""


def register(store: dist.Store, slot: int | None) -> tuple[int, int]:
    """Register this process: its `uid` (a counter, never reused) and the generation counter.

    Call it before this process's first heartbeat: a generation that lets it in is decided
    after that beat, so it comes after the counter read here (read later, the counter may
    already have moved past the generation that took it in, and the wait would be for the
    next one).

    Args:
        store: the job's store, under `LiveGroup`'s prefix.
        slot: this process's launcher RANK, which orders generation 0 (None: the uid).
    """
    uid = store.add("uids", 1) - 1
    store.set(f"pid/{uid}", str(os.getpid()))
    store.set(f"slot/{uid}", str(uid if slot is None else slot))
    return uid, int(store.add("generations", 0))


def wait_for(store: dist.Store, key: str, what: str, timeout_s: float) -> None:
    """Wait until `key` is set in `store`, or the job finished; TimeoutError after `timeout_s`.

    A spare waits for generation 0 this way before registering: a uid below `world_size`
    would be a place in generation 0, and a spare must never take one.
    """
    deadline = time.monotonic() + timeout_s
    while not store.check([key]) and not store.check(["finished"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}: start the job's workers "
                               "with the same store")
        time.sleep(0.05)


def generation0_members(store: dist.Store, world_size: int, timeout_s: float) -> list[int]:
    """Generation 0's members, in rank order, once `world_size` processes registered.

    All registered first: the rendezvous starts everywhere at once (slow imports). The first
    proposal written (compare-and-set) is generation 0 for everyone.
    """
    deadline = time.monotonic() + timeout_s
    while (registered := store.add("uids", 0)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {registered} of world_size={world_size} processes registered "
                f"within {timeout_s:g} s; start the others with the same store")
        time.sleep(0.01)
    first = generation0(store, world_size, timeout_s)
    return decode(store.compare_set("gen0/members", "", encode(first)))


def wait_to_be_let_in(store: dist.Store, beats: Heartbeats, uid: int, first_generation: int, *,
                      spare: bool, timeout_s: float, heartbeat_s: float,
                      dead_after_s: float) -> tuple[int, list[int]] | None:
    """A replacement's or a spare's wait: (g, members) of the first generation from
    `first_generation` on that lists `uid`, or None if the job finished first.

    Raises `LiveJobLostError` once every member of the newest generation is gone (checked
    every `heartbeat_s`), and TimeoutError after `timeout_s` (a spare waits for as long as the
    job runs, and polls less: it is idle).
    """
    g = first_generation
    if spare:
        deadline, poll_s = float("inf"), 0.05
    else:
        deadline, poll_s = time.monotonic() + timeout_s, 0.01
    next_check = 0.0
    while True:
        if store.check([f"gen{g}/members"]):
            members = decode(store.get(f"gen{g}/members"))
            if uid in members:
                return g, members
            g += 1
            continue
        if store.check(["finished"]):
            return None
        if g > 0 and time.monotonic() >= next_check:  # anyone left to let this one in?
            next_check = time.monotonic() + heartbeat_s
            raise_if_all_gone(store, beats, uid, g - 1, dead_after_s)
        if time.monotonic() > deadline:
            raise TimeoutError(f"replacement uid {uid} was not let in within {timeout_s:g} s "
                               f"(generation {g - 1} is full or its members never reached a "
                               "step boundary)")
        time.sleep(poll_s)


def raise_if_all_gone(store: dist.Store, beats: Heartbeats, uid: int, g: int,
                      dead_after_s: float) -> None:
    """Raise `LiveJobLostError` if every member of generation g (the newest) is departed or
    silent for `dead_after_s`: no generation will ever let process `uid` in."""
    members = decode(store.get(f"gen{g}/members"))
    if all_gone(store, beats, members):
        raise LiveJobLostError(
            f"uid {uid} waits to be let in, but every member of generation {g} "
            f"({members}) is gone (departed or silent for over {dead_after_s:g} s): "
            "no survivor holds the job's state. The job fails so that it restarts from its "
            "last snapshot: run the same command again (with --live-wait S the survivors "
            "wait for replacements, so one fault cannot take every member)")
