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

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


class LiveMemberSilentError(RuntimeError):
    """A member's heartbeat stopped while this process waited on a collective with it."""


class _WatchedWork(dist.Work):
    def __init__(self, work: dist.Work, check: Callable[[], None], slice_s: float,
                 point_to_point: bool = False):
        super().__init__()
        self._work, self._check, self._slice = work, check, timedelta(seconds=slice_s)
        self._point_to_point = point_to_point

    def wait(self, timeout: timedelta | None = None) -> bool:
        # `timeout` is ignored: the group's own timeout bounds the collective, `check` a peer.
        if self._point_to_point:
            return self._wait_in_thread()
        while True:
            try:
                return self._work.wait(self._slice)
            except RuntimeError:
                if self._work.is_completed():  # done meanwhile, or failed by itself (a reset
                    return self._work.wait()   # peer): its own result or error
            self._check()  # a slice ran out with the collective still in flight

    def _wait_in_thread(self) -> bool:
        """A send's or recv's wait, unbounded, on a thread; `check` between slices here.

        gloo waits for a send or recv on its buffer, and a wait there that times out closes
        every connection of the group ("Application timeout caused pair closure", gloo's
        UnboundBuffer::waitRecv): a sliced wait broke the group whenever a peer sent more than
        a slice late (ZeRO's ring under load). A collective's wait does not (it waits on its
        work's future), so only these take a thread, left blocked if `check` raises (it ends
        with the group's timeout or its failure).
        """
        done: dict[str, object] = {}

        def wait() -> None:
            try:
                done["result"] = self._work.wait()
            except RuntimeError as error:
                done["error"] = error

        thread = threading.Thread(target=wait, daemon=True, name="ringtrain-live-p2p-wait")
        thread.start()
        while True:
            thread.join(self._slice.total_seconds())
            if not thread.is_alive():
                break
            self._check()
        if "error" in done:
            raise done["error"]  # type: ignore[misc]
        return bool(done["result"])

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
        self._works: list[_WatchedWork] = []  # issued and maybe still in flight

    def idle(self) -> bool:
        """Whether no collective issued on it is still in flight (done, or failed)."""
        self._works = [w for w in self._works if not w.is_completed()]
        return not self._works


class RetiredGroups:
    """Past generations' groups, released once nothing is in flight in them.

    A group whose peer died is not just dead weight: gloo leaves the broken connections
    registered with its device's event loop, and its `gloo_tcp_loop` thread then wakes up on
    them without end (`epoll_wait` returning the same readable socket every call: 20-90 % of a
    core per survivor, measured in benchmarks/live_recovery.py, where every step after the
    first regroup took 1.3x as long). Dropping the group closes them and ends that thread. It
    cannot be dropped at once: gloo's destructor waits for a collective still in flight (one
    abandoned on a frozen member ends only at the group's timeout) while holding the GIL, so a
    thread of this class drops each group once `WatchedGroup.idle()`, off the training thread.
    """

    def __init__(self, poll_s: float = 0.2):
        self._poll_s = poll_s
        self._groups: list[WatchedGroup] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, group: WatchedGroup) -> None:
        with self._lock:
            self._groups.append(group)
            if self._thread is None:
                self._thread = threading.Thread(target=self._release, daemon=True,
                                                name="ringtrain-live-retired")
                self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def _release(self) -> None:
        while True:
            time.sleep(self._poll_s)
            with self._lock:
                # The last reference to an idle group goes here: its destructor runs on this
                # thread (the caller keeps no other: `LiveGroup` hands it over).
                self._groups = [g for g in self._groups if not g.idle()]
                if not self._groups:
                    self._thread = None
                    return


_POINT_TO_POINT = ("send", "recv", "recv_anysource")


def _forward(name: str):
    def collective(self: WatchedGroup, *args, **kwargs) -> dist.Work:
        work = _WatchedWork(getattr(self.process_group, name)(*args, **kwargs), self._check,
                            self._slice_s, point_to_point=name in _POINT_TO_POINT)
        self._works = [w for w in self._works if not w.is_completed()]
        self._works.append(work)
        return work

    collective.__name__ = name
    collective.__doc__ = f"`{name}` of the wrapped group; its work waits in watched slices."
    return collective


# `dist.ProcessGroup`'s own methods of these names would run with no backend: each is replaced.
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
              "allgather_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base",
              "gather", "scatter", "alltoall", "alltoall_base", "barrier", *_POINT_TO_POINT):
    setattr(WatchedGroup, _name, _forward(_name))
