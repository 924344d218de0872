"""What a watchdog found, and the default reaction to it: one line, the error file, the exit.

    failure = PeerFailure("died", 1, "no heartbeat for 30 s")
    exit_on_peer_failure(rank=0, failure=failure)    # prints "[rank 0] rank 1 died (...)", exits 75

Used by `ringtrain.launch.watchdog.Watchdog` (which finds failures) and by the launcher's
failure report (which reads the exit codes and error files back).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from ringtrain.launch.hang import describe_main_thread

# sysexits' EX_TEMPFAIL: "a peer failed, this rank is fine; restarting the group may help".
# The launcher uses it to tell ranks that stopped because of a peer from the root cause.
PEER_FAILED_EXIT_CODE = 75

@dataclass(frozen=True)
class PeerFailure:
    """What the watchdog found: `kind` is "failed" (raised), "died" (silent), "hung" (never
    entered the collective the others wait in, `ringtrain.launch.hang`) or "store" (lost)."""

    kind: str
    rank: int | None  # the rank at fault; None when the store's host is not a rank's process
    reason: str

    def __str__(self) -> str:
        if self.kind == "failed":
            return f"rank {self.rank} failed {self.reason}"
        if self.kind == "hung":
            return f"rank {self.rank} hangs: {self.reason}"
        if self.kind == "died":
            return f"rank {self.rank} died ({self.reason})"
        return self.reason


def uneven_hint(finished: list[int]) -> str:
    """Why a connection was lost when peers had finished their scripts (`Watchdog`): said
    before the error, which only names the lost connection."""
    who = (f"rank {finished[0]} had" if len(finished) == 1 else
           f"ranks {', '.join(map(str, finished))} had")
    return (f"still in a collective after {who} finished the script: the ranks ran different "
            "numbers of steps or collectives, e.g. a different number of batches per rank (a "
            "dataset of another length on some rank, or a loop bound that depends on the "
            "rank; with DistributedDataParallel, `with model.join():` around the loop lets ranks "
            "run out of batches at different steps), or a forward through DistributedDataParallel "
            "on some ranks only (it syncs buffers in forward: evaluate on one rank through "
            "`model.module`); RINGTRAIN_DEBUG=collectives names the first collective the ranks "
            "disagree on; the error was: ")


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__


def tcp_store(store: dist.Store) -> dist.Store | None:
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store if hasattr(store, "host") else None


def write_error_file(message: str, callstack: str | None = None, *,
                     replace: bool = True) -> None:
    """Tell the launcher why this rank stops: torch's error file (TORCHELASTIC_ERROR_FILE, the
    format of torch's `@record`), which `ringtrain run`'s report quotes. Without a callstack
    (the rank prints its own traceback) the report gives the message alone. Nothing outside a
    launcher; `replace=False` keeps a file `@record` wrote first (its traceback is fuller)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or (not replace and os.path.exists(error_file)):
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack or message, "timestamp": str(int(time.time()))}}}
    try:
        with open(error_file, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def exit_on_peer_failure(rank: int, failure: PeerFailure) -> None:
    """The default reaction: one line on stderr, the launcher's error file, then `os._exit`.

    `os._exit` because the main thread may be stuck in a collective that will never return:
    a normal exit would wait for it (and for atexit handlers that call into the dead group).
    A rank that found itself hanging (`failure.rank == rank`) is the cause, not a symptom:
    it also prints where its main thread is stuck and exits with 1, not PEER_FAILED_EXIT_CODE.
    """
    own = failure.kind == "hung" and failure.rank == rank
    stack = describe_main_thread(rank) if own else ""
    print(f"[rank {rank}] {failure}" + (f"\n{stack}" if stack else ""), file=sys.stderr, flush=True)
    text = f"{'RankHung' if own else 'PeerFailure'}: {failure}"
    write_error_file(text, stack)
    sys.stdout.flush()
    os._exit(1 if own else PEER_FAILED_EXIT_CODE)
