"""`WatchedGroup`'s waits: a send or recv that outlasts a watch slice leaves the group working.

    .venv/bin/pytest -q tests/test_live_watched.py

gloo closes every connection of a group when a wait for a send or recv times out ("Application
timeout caused pair closure"), so the watch cannot slice those waits as it slices a
collective's (ringtrain/live/watched.py). Two members on threads of this process, one store.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtrain.live import WatchedGroup
from ringtrain.live.watched import LiveMemberSilentError

LATE_S = 0.4  # eight of the watch's 0.05 s slices


def _member(rank: int, store: dist.Store, out: dict, check, all_reduce: bool) -> None:
    group = WatchedGroup(dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)), check)
    try:
        x = torch.full((1000,), float(rank + 1))
        if rank == 0:
            time.sleep(LATE_S)  # the receiver waits meanwhile, over several slices
            group.send([x], 1, 0).wait()  # what dist.send(x, group_dst=1, group=group) calls
        else:
            group.recv([x], 0, 0).wait()
        total = torch.ones(1)
        if all_reduce:
            group.allreduce([total]).wait()  # the group still works after the late send
        out[rank] = (x[0].item(), total.item())
    except RuntimeError as error:
        out[rank] = error


def _run(check, all_reduce: bool = True) -> dict:
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_member, args=(r, store, out, check, all_reduce))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # Nothing may be left in flight: a gloo group dropped with a collective in flight blocks
    # its destructor, holding the GIL, until the group's timeout (every thread of this pytest
    # process stood still for ~28 s, and the next file's store watch took its store for lost).
    deadline = time.monotonic() + 10
    while any(t.name == "ringtrain-live-p2p-wait" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an abandoned recv is still waiting"
        time.sleep(0.05)
    return out


def test_a_late_send_is_received_and_the_group_goes_on():
    checks = []
    out = _run(lambda: checks.append(time.monotonic()))
    assert out == {0: (1.0, 2.0), 1: (1.0, 2.0)}, out
    assert len(checks) >= 3  # the receiver's wait was watched while it lasted


def test_a_silent_member_still_ends_a_recv():
    """The watch still raises in a recv whose peer is found silent (the check raises)."""
    started = time.monotonic()

    def check():
        if time.monotonic() - started > 0.1:
            raise LiveMemberSilentError("member 0 is silent")

    out = _run(check, all_reduce=False)  # the sender sends late, and nothing else is issued
    assert isinstance(out[1], LiveMemberSilentError), out
    assert out[0] == (1.0, 1.0), out  # its send landed in the abandoned recv's buffer
    assert time.monotonic() - started < 20  # not the group's 30 s timeout
