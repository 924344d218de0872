"""`StopSignal`: a signal (SIGTERM, SIGINT, SIGUSR1) becomes a request to save and stop.

    with ringtrain.StopSignal() as stop:
        for step in ...:
            ...
            if stop.agreed():      # every rank, each step: one all-reduce of one int
                snapshots.save(step, shared=...); snapshots.close(); sys.exit(143)

Apart from the snapshots (`resume.py`) because it is process plumbing, not state: it swaps
signal handlers in and out and knows nothing of what is saved; the training loop decides which
signals to catch (`ringtrain.training.snapshots.STOP_SIGNALS`) and what a stop does (the
trainer votes through its strategy's agreement; a script calls `agreed`).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives

__all__ = ["StopSignal"]


def _signal(s: int | str) -> signal.Signals:
    """signal.SIGTERM, 15, "SIGTERM" or "term" -> signal.SIGTERM; a ValueError otherwise."""
    try:
        if isinstance(s, str):
            name = s.strip().upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(s)
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"StopSignal(signals=...): {s!r} is not a signal of this system; give "
                         "signal.SIGTERM or a name such as 'SIGTERM' or 'SIGUSR1'") from None


class StopSignal:
    """A signal (by default SIGTERM, SIGINT, SIGUSR1) becomes a request to save and stop at
    the next step boundary.

    The handler only sets a flag (a signal may land anywhere, e.g. inside a collective's
    Python wrapper); the loop votes on the flag through the strategy's agreement at each step
    boundary, so all ranks stop at the same step even when only one was signalled.

    .. warning:: On the way out with an exception (other than SystemExit), a signal that
       arrived is delivered again to the previous handler (by default: the process ends). An
       agent that stops the group after a peer died sends SIGTERM and waits for the workers to
       exit; it must not wait for a rank that would otherwise go on reporting a lost
       connection.
    """

    def __init__(self, signals: tuple[int | str, ...] = (signal.SIGTERM, signal.SIGINT,
                                                        signal.SIGUSR1)):
        self.signals = tuple(_signal(s) for s in signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def agreed(self, process_group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank of `process_group` (default: all) has received a signal: the same
        answer on every rank, so all save the same step and stop. Call it on every rank at the
        same steps (a collective: one all-reduce of one int). Without a group: this rank's."""
        if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
            return self.received is not None
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32,
                            device=collectives.tensor_device(process_group))
        collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        # A SystemExit is the script's own exit after it saved (sys.exit(143)): not delivered
        # again, which would end it with a KeyboardInterrupt's traceback after Ctrl-C.
        if exc is not None and not isinstance(exc, SystemExit) and self.received is not None:
            os.kill(os.getpid(), self.received)
