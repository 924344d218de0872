"""`WatchedGroup`: a gloo group whose waits give up as soon as a member's heartbeat stops.

    group = WatchedGroup(dist.ProcessGroupGloo(...), check=live_group.check_members)
    dist.all_reduce(tensor, group=group)   # raises LiveMemberSilentError ~1 s after a peer hangs

A collective whose peer was SIGKILLed fails at once (its sockets are reset), but one whose peer
is frozen (SIGSTOP, a lost link: no FIN, no RST) waits out the group's whole timeout, and that
timeout cannot be short: a member that is merely slow (a 1 s step, a loaded host) must not be
taken for a dead one. Gloo cannot abort a wait in flight (`abort()` and `shutdown()` from
another thread leave it blocked until its timeout, torch 2.13), so every wait here is cut into
slices of `slice_s`, and between two slices `check()` looks at the members' heartbeats, which a
thread beats whatever the step is doing: a silent member makes it raise, and the collective is
abandoned with its group (torchft does the same with its short-timeout gloo group).

Every collective of `dist.ProcessGroup` is forwarded to the gloo group; the `Work` returned
waits in slices. The group itself is never registered with torch's default group.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


class LiveMemberSilentError(RuntimeError):
    """A member's heartbeat stopped while this process waited on a collective with it."""


class _WatchedWork(dist.Work):
    def __init__(self, work: dist.Work, check: Callable[[], None], slice_s: float):
        super().__init__()
        self._work, self._check, self._slice = work, check, timedelta(seconds=slice_s)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # `timeout` is ignored: the group's own timeout bounds the collective, `check` a peer.
        while True:
            try:
                return self._work.wait(self._slice)
            except RuntimeError:
                if self._work.is_completed():  # done meanwhile, or failed by itself (a reset
                    return self._work.wait()   # peer): its own result or error
            self._check()  # a slice ran out with the collective still in flight

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._work.result()

    def get_future(self):
        return self._work.get_future()


class WatchedGroup(dist.ProcessGroup):
    """A process group forwarding to `process_group`; its collectives wait in watched slices.

    Args:
        process_group: the group doing the work (a `ProcessGroupGloo`).
        check: raises (a `RuntimeError`) when a member is found lost; called every `slice_s`
            while a collective is in flight.
        slice_s: how long one wait lasts before `check` runs.
    """

    def __init__(self, process_group: dist.ProcessGroup, check: Callable[[], None],
                 slice_s: float = 0.05):
        super().__init__(process_group.rank(), process_group.size())
        self.process_group, self._check, self._slice_s = process_group, check, slice_s


def _forward(name: str):
    def collective(self: WatchedGroup, *args, **kwargs) -> dist.Work:
        work = getattr(self.process_group, name)(*args, **kwargs)
        return _WatchedWork(work, self._check, self._slice_s)

    collective.__name__ = name
    collective.__doc__ = f"`{name}` of the wrapped group; its work waits in watched slices."
    return collective


# `dist.ProcessGroup`'s own methods of these names would run with no backend: each is replaced.
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
              "allgather_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base",
              "gather", "scatter", "alltoall", "alltoall_base", "barrier", "send", "recv",
              "recv_anysource"):
    setattr(WatchedGroup, _name, _forward(_name))
