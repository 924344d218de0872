"""Which ranks are still in the job, and sums over the live ones, through the rendezvous store.

    membership = Membership.of(get_runtime(), "trainer")
    totals = membership.reduce("step-40", [loss_sum, count])   # every live rank, same order

Used where a job goes on after losing a rank (a parameter-server worker in async/ssp mode,
`ringtrain train --strategy ps --ps-mode async`): a world collective would wait for, or fail
on, the dead rank; the store does not. Tests: `.venv/bin/pytest -q tests/test_trainer.py -k store`.

A rank is *departed* once someone who knows says so (a parameter server that lost its
connection, a watchdog that heard nothing): `depart(rank, why)` writes a key every rank reads.
`gather(tag, payload)` is consistent: each rank writes its payload under (tag, rank); a reader
waits for every rank's key, and gives up on a rank only when it has departed, by writing
DEPARTED into that rank's key with compare-and-set. A key is written once, by the rank or by
the first reader who gave up, so every reader sees the same set of payloads and the same sums
(added in rank order: bit-identical on every rank, as an all-reduce is).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable

import torch.distributed as dist

from ringtrain.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S, Runtime
from ringtrain.store_keys import claim_key

DEPARTED = b"DEPARTED"


class MemberDepartedError(RuntimeError):
    """This rank was declared departed by the others (it was silent too long): it cannot rejoin."""


class Membership:
    """A view of the job's live ranks, kept in the store (every view of one job agrees).

    Args:
        store: the rendezvous store (`runtime.store`); a clone is used, so waits here never
            block another thread's store calls.
        rank, world_size: this rank and the job's size.
        scope: names this view's `gather` keys, the same on every rank ("trainer"), whatever
            order the views are made in; a second view of this rank on the same store and
            prefix needs another scope (ValueError otherwise: their gathers would mix).
            Which ranks departed is shared by every scope of the job.
        timeout_s: bound on waiting for a live rank's payload.
        prefix: the job's key prefix; default unique per run and restart.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, scope: str = "default",
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, prefix: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {world_size - 1}]")

        if prefix is None:
            prefix = (f"ringtrain/membership/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/"
                      f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        claim_key(store, f"{prefix}/{scope}", rank, "Membership", scope)
        try:
            store = store.clone()
        except (AttributeError, RuntimeError):  # an in-process store (HashStore): shared is fine
            pass
        self._store = dist.PrefixStore(prefix, store)
        self.rank, self.world_size, self.scope, self.timeout_s = rank, world_size, scope, timeout_s
        self._departed: dict[int, str] = {}  # grows only: a departed rank never comes back

    @classmethod
    def of(cls, runtime: Runtime, scope: str, **kw) -> Membership:
        """This rank's view named `scope` ("trainer"): every rank's view of that name meets it."""
        return cls(runtime.store, runtime.rank, runtime.world_size, scope=scope, **kw)

    # -- who is in ----------------------------------------------------------------------------
    def depart(self, rank: int, reason: str) -> bool:
        """Declare `rank` gone for good; True for the first caller in the whole job only.

        The first caller's `reason` is the one every rank reads (`departed()`).
        """
        # Never empty (an empty value reads as unset); the writer's rank makes each caller's
        # value its own, so only the first caller sees its value come back.
        reason = f"{reason or 'no reason given'} (seen by rank {self.rank})"
        won = self._store.compare_set(f"departed/{rank}", "", reason.encode()) == reason.encode()
        self._departed.setdefault(rank, reason)
        return won

    def departed(self) -> dict[int, str]:
        """rank -> why, for every rank declared departed so far."""
        for r in range(self.world_size):
            self.is_departed(r)
        return dict(self._departed)

    def is_departed(self, rank: int) -> bool:
        if rank not in self._departed and self._store.check([f"departed/{rank}"]):
            self._departed[rank] = self._store.get(f"departed/{rank}").decode(errors="replace")
        return rank in self._departed

    def live(self, ranks: Iterable[int] | None = None) -> list[int]:
        """The ranks (of `ranks`, default all) not departed."""
        gone = self.departed()
        return [r for r in (range(self.world_size) if ranks is None else ranks) if r not in gone]

    # -- collectives that leave the departed out --------------------------------------------------
    def gather(self, tag: str, payload: bytes) -> dict[int, bytes]:
        """Every live rank's payload for `tag` (this rank's included), the same on every rank.

        Call it on every live rank with a tag used once. Raises TimeoutError naming the ranks
        still missing after `timeout_s` (alive by the membership, but silent), and
        `MemberDepartedError` if this rank itself was given up on.
        """
        key = f"{self.scope}/{tag}/{{}}".format
        # Never an empty value: compare_set treats an empty value as "not set yet".
        if self._store.compare_set(key(self.rank), "", b"v" + payload) == DEPARTED:
            raise MemberDepartedError(
                f"rank {self.rank} reached {tag!r} after the others had declared it departed "
                f"({self.departed().get(self.rank, 'no reason recorded')}); it cannot rejoin")
        out: dict[int, bytes] = {}
        waiting = list(range(self.world_size))
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while waiting:
            for r in list(waiting):
                if self._store.check([key(r)]):
                    value = self._store.get(key(r))
                elif self.is_departed(r):  # settle it: its key ends as its payload or DEPARTED
                    value = self._store.compare_set(key(r), "", DEPARTED)
                else:
                    continue
                waiting.remove(r)
                if value != DEPARTED:
                    out[r] = value[1:]
            if waiting:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {self.rank}: ranks {waiting} did not reach {tag!r} within "
                        f"{self.timeout_s:g} s and none of them is known to have left the job")
                time.sleep(pause)
                pause = min(2 * pause, 0.02)  # fast when peers are close, cheap when one lags
        return out

    def reduce(self, tag: str, values: list[float]) -> list[float]:
        """Sum `values` over the live ranks (the same length on every rank), like an all-reduce."""
        fmt = f"<{len(values)}d"
        parts = self.gather(tag, struct.pack(fmt, *values))
        total = [0.0] * len(values)
        for r in sorted(parts):  # rank order: every reader adds the same numbers the same way
            for i, v in enumerate(struct.unpack(fmt, parts[r])):
                total[i] += v
        return total
