"""Naming a rank that hangs: the one that never entered the collective the others wait in.

A rank stuck in its own code (a deadlock, an endless loop, a `sleep`, long work on one rank
while the others wait) keeps heartbeating, so the watchdog's silence rule never finds it, and
the ranks waiting for it sit in their collective until the backend's timeout (300 s), each
blaming itself. Collective counts find it: every rank counts the collectives it has issued on
the groups that span the whole world (torch's per-group sequence numbers, counted when a
collective is issued, not when it completes) and publishes the count with its heartbeat. When
the counts differ and none has moved for `timeout_s`, the ranks behind have not entered a
collective that the ranks ahead are blocked in: they hang, and the ones ahead only wait.

The check is pure (`HangCheck`, fed counts and times) and tested without processes; the
watchdog feeds it (`ringtrain.launch.watchdog`), and a rank that finds itself behind reports itself
with the stack of its main thread (`describe_main_thread`), so the report shows where it is stuck.
"""

from __future__ import annotations

import runpy
import sys
import threading
import traceback
from dataclasses import dataclass

from ringtrain.torch_internals import process_groups, sequence_number


def collective_progress(world_size: int) -> int:
    """Collectives this rank has issued on groups of all `world_size` ranks (the world, lanes)."""
    total = 0
    for group in process_groups():
        try:
            if group.size() == world_size:
                total += sequence_number(group)
        except RuntimeError:  # a group being destroyed under us: it counts no more
            continue
    return total


@dataclass(frozen=True)
class Hang:
    """Ranks `behind` have not entered collective number `waited_in`, which `ahead` wait in."""

    behind: list[int]
    ahead: list[int]
    waited_in: int
    stuck_s: float

    def reason(self) -> str:
        return (f"it has not entered collective #{self.waited_in} on the world group, which "
                f"rank{'s' if len(self.ahead) > 1 else ''} {_ranks(self.ahead)} "
                f"{'have' if len(self.ahead) > 1 else 'has'} waited in for {self.stuck_s:.1f} s "
                "(no rank issued a collective since); if it does long work alone on purpose, "
                "raise --watchdog-timeout (0 turns the watchdog off)")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class HangCheck:
    """Tracks every rank's collective count and when it last moved (the caller's clock).

    Args:
        timeout_s: how long no count may move while the counts differ before it is a hang.
    """

    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: it must be positive")
        self.timeout_s = timeout_s
        self._count: dict[int, int] = {}
        self._moved: dict[int, float] = {}

    def observe(self, rank: int, count: int, now: float) -> None:
        """Record `rank`'s count as read at time `now`."""
        if self._count.get(rank) != count:
            self._count[rank], self._moved[rank] = count, now

    def forget(self, rank: int) -> None:
        """`rank` finished or departed: it neither waits nor is waited for."""
        self._count.pop(rank, None)
        self._moved.pop(rank, None)

    def hang(self, ranks: list[int], now: float) -> Hang | None:
        """The hang among `ranks` (all observed), or None while counts agree or still move."""
        counts = {r: self._count[r] for r in ranks if r in self._count}
        if len(counts) < 2:
            return None
        lead = max(counts.values())
        if min(counts.values()) == lead:
            return None
        stuck = now - max(self._moved[r] for r in counts)
        if stuck <= self.timeout_s:
            return None
        return Hang(behind=sorted(r for r, c in counts.items() if c < lead),
                    ahead=sorted(r for r, c in counts.items() if c == lead),
                    waited_in=lead, stuck_s=stuck)


def describe_main_thread(rank: int) -> str:
    """Where this process's main thread is now: what a rank that hangs reports about itself."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    # From the program's own first frame: a `python -m` run, and a process forked from a warm
    # one (launch/zygote_server.py), start it through runpy, whose frames say nothing here.
    ran = [i for i, f in enumerate(frames) if f.filename in ("<frozen runpy>", runpy.__file__)]
    stack = "".join(traceback.format_list(frames[ran[-1] + 1:] if ran else frames)).rstrip()
    return f"Stack of rank {rank}'s main thread (where it is stuck):\n{stack}"
