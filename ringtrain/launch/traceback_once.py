"""One traceback per error, not one per rank: ranks that raise the same error print it once.

    print_once(store, rank, exc, said, print_full)   # in an excepthook, or before a re-raise

A mistake in a user's model (a shape, a dtype, a device) raises on every rank at the same step,
and each printed the same 20-line traceback: 8 copies from an 8-GPU node, their lines
interleaved, and the launcher's report under them. Through the rendezvous store the first rank
to claim a traceback's text prints it; every other rank whose traceback is the same text waits
for that print (at most `WAIT_S`) and says one line instead, naming that rank. A traceback of
other text (another line, another message: a rank-specific value, another device) is printed
in full, as before. Where the store does not answer, or the first rank dies before its print is
done, each rank prints its own: a traceback may repeat, but is never lost.
"""

from __future__ import annotations

import hashlib
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

WAIT_S = 2.0  # for the first rank's print: milliseconds when it is alive


def _key(text: str) -> str:
    return "traceback/" + hashlib.sha256(text.encode(errors="replace")).hexdigest()[:24]


def claim_traceback(store: dist.Store, rank: int, text: str) -> int | None:
    """The rank that prints `text`: this one if it is the first to ask; None: no store answer
    (print it here)."""
    try:  # atomic: set to this rank unless a rank set it first; returns the value now held
        return int(store.compare_set(_key(text), "", str(rank)).decode())
    except (RuntimeError, ValueError):
        return None


def mark_printed(store: dist.Store, text: str) -> None:
    """Tell the ranks waiting in `same_as` that `text` is out."""
    try:
        store.set(_key(text) + "/printed", "1")
    except RuntimeError:
        pass  # they time out and print it themselves


def same_as(store: dist.Store, rank: int, text: str, first: int) -> bool:
    """Wait (bounded) for rank `first` to have printed `text`; False: print it here after all."""
    try:
        store.wait([_key(text) + "/printed"], timedelta(seconds=WAIT_S))
    except RuntimeError:  # timed out, or the store went: the first rank's print may be lost
        return False
    return True


def print_once(store: dist.Store, rank: int, exc: BaseException, said: str,
               print_full: Callable[[], None], prefix: str = "[rank{rank}]: ") -> None:
    """Print `exc`'s traceback (`print_full`), or one line naming the rank that printed the same
    text; `said` is the exception in one line, `prefix` the rank's mark on that line (torch's
    `[rankN]: ` for a script's, `[rank N] ` in `ringtrain train`'s log)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    first = claim_traceback(store, rank, text)
    if first is not None and first != rank and same_as(store, rank, text, first):
        print(f"{prefix.format(rank=rank)}{said} (the same traceback as rank {first}'s, printed "
              "in its output)", file=sys.stderr, flush=True)
        return
    print_full()
    sys.stderr.flush()
    if first == rank:
        mark_printed(store, text)
