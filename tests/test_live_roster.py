"""`LiveGroup`'s decisions that need no process group, in this process (gloo, CPU, no workers):

- a replacement waiting to be let in fails fast (`LiveJobLostError`) once every member of the
  newest generation is gone, instead of waiting out its join bound (600 s in `ringtrain train`);
- a survivor waiting for replacements (`replace_wait_s`, `--live-wait`) stops waiting once a
  stop is requested (SIGTERM), so the job's usual stop path runs before the agent's shutdown
  timeout; and a member the agent marked departed (its process exited) is lost at once, not
  after `dead_after_s`;
- `propose`: survivors keep their ranks, a waiting process takes a lost member's;
- a waiting spare cut off with the members it would replace (its counter stopped before the
  fault) is not let in: its silence is timed from before the fault (issue 26);
- a beat's reads (one `multi_get`) see what one request per counter sees, and a process
  registered but not yet beating does not stall them.

The store is a `HashStore` here; the keys written by hand are the ones a member would write
(ringtrain/live/roster.py names them).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.live import GlobalBatches, LiveGroup, LiveJobLostError, LiveState
from ringtrain.live.heartbeats import Heartbeats
from ringtrain.live.roster import propose, waiting_uids

PREFIX = "ringtrain/live/live"  # LiveGroup(name="live")


def _job_of_one_member_gone() -> dist.Store:
    """A job whose generation 0 was uid 0 alone; uid 0 beat once and then never again."""
    store = dist.HashStore()
    keys = dist.PrefixStore(PREFIX, store)
    keys.add("uids", 1)
    keys.add("hb/0", 1)
    keys.set("gen0/members", "0")
    return store


class _Prepared(LiveState):
    """A replacement's state that records its own heartbeat counter when asked to prepare."""

    def __init__(self, keys: dist.Store, uid: int):
        model = torch.nn.Linear(4, 2)
        super().__init__(model, torch.optim.AdamW(model.parameters()), GlobalBatches(8, 2))
        self.keys, self.uid = keys, uid
        self.beats_seen: list[int] = []

    def prepare_heal(self) -> None:
        self.beats_seen.append(self.keys.add(f"hb/{self.uid}", 0))
        super().prepare_heal()


def test_a_replacement_fails_fast_once_every_member_is_gone():
    store = _job_of_one_member_gone()
    group = LiveGroup(store, 1, heartbeat_s=0.05, dead_after_s=0.3, join_timeout_s=60)
    state = _Prepared(dist.PrefixStore(PREFIX, store), group.uid)
    try:
        started = time.monotonic()
        with pytest.raises(LiveJobLostError, match=r"every member of generation 0 \(\[0\]\) is "
                                                   "gone.*restarts from its last snapshot"):
            group.join(state)
        assert time.monotonic() - started < 10  # the silence bound and a poll, not 60 s
    finally:
        group.close()
    # It made its optimizer's state before its first beat: the members would have waited for
    # it inside a step boundary, had they let it in while it did.
    assert state.beats_seen == [0] and state.optimizer.state
    assert state.keys.add(f"hb/{group.uid}", 0) > 0


def test_a_survivor_waiting_for_a_replacement_stops_waiting_on_a_stop_request():
    store = dist.HashStore()
    stop = threading.Event()
    group = LiveGroup(store, 2, heartbeat_s=0.05, dead_after_s=30, replace_wait_s=120,
                      stop_requested=stop.is_set)
    keys = dist.PrefixStore(PREFIX, store)
    keys.add("uids", 1)  # uid 1, the other member: its agent saw it exit
    keys.add("hb/1", 1)
    keys.set("departed/1", b"1")
    out: dict = {}

    # As after generation 0 formed with uids 0 and 1 (its group is never built here).
    group.generation, group.members = 0, [0, 1]
    group._known.update(group.members)

    def decide() -> None:  # what `recover` does after a failed step: the next generation
        keys.set("gen1/here/0", b"1")
        out["members"] = group._decide(1, [0, 1])

    thread = threading.Thread(target=decide, daemon=True)
    try:
        started = time.monotonic()
        thread.start()
        time.sleep(0.5)  # departed, not silent for 30 s: lost at once, waiting for a replacement
        assert thread.is_alive() and "members" not in out
        stop.set()  # SIGTERM: the loop's StopSignal
        thread.join(timeout=10)
        assert out.get("members") == [0]  # went on alone, well before replace_wait_s
        assert time.monotonic() - started < 10
    finally:
        stop.set()
        group.close()


def test_survivors_keep_their_ranks_and_a_waiting_process_takes_a_lost_ones():
    assert propose([0, 1, 2], here=[0, 2], waiting=[5], world_size=3) == [0, 5, 2]
    assert propose([0, 1, 2], here=[0, 2], waiting=[], world_size=3) == [0, 2]
    assert propose([0, 1], here=[0, 1], waiting=[4, 5], world_size=3) == [0, 1, 4]


def test_a_waiting_spare_silent_since_before_the_fault_is_not_let_in():
    # Issue 26: host b's link went down with its warm spare; the survivors first read the
    # spare's counter when proposing the next generation, so it looked fresh and was let in.
    store = dist.HashStore()
    group = LiveGroup(store, 2, heartbeat_s=0.05, dead_after_s=0.3)  # uid 0
    keys = dist.PrefixStore(PREFIX, store)
    keys.add("uids", 2)  # uid 1: the spare cut off; uid 2: a spare still beating
    keys.add("hb/1", 1)
    group.generation, group.members = 0, [0]  # as after generation 0 formed (no group built)
    group._known.update(group.members)
    try:
        deadline = time.monotonic() + 1.0  # well past dead_after_s: uid 1 silent since start
        while time.monotonic() < deadline:
            keys.add("hb/2", 1)
            time.sleep(0.05)
        assert waiting_uids(keys, group._beats, group._known) == [2]
    finally:
        group.close()


def test_a_beats_batched_reads_see_what_one_read_per_counter_sees():
    store = dist.PrefixStore(PREFIX, dist.HashStore())
    store.set_timeout(timedelta(seconds=30))  # a `multi_get` of a missing key would wait this
    members, known = [0, 1, 2], {3}  # uid 3: departed; uids 4, 5: waiting (5 not beating yet)
    for u in range(5):
        store.add("uids", 1)
        store.add(f"hb/{u}", 1)
    store.add("uids", 1)
    beats = [Heartbeats(store, store, 0, heartbeat_s=0.1, dead_after_s=0.5,
                        members=lambda: members, known=lambda: known) for _ in range(2)]
    started = time.monotonic()
    for count in range(1, 4):
        for u in (1, 4):
            store.add(f"hb/{u}", 1)  # uids 1 and 4 beat; 0, 2 and 5 do not
        beats[0]._read_counters(store)
        beats[1]._read_counters_naive(store)
        counts = [{u: c for u, (c, _) in b._moved.items()} for b in beats]
        assert counts[0] == counts[1] == {0: 1, 1: 1 + count, 2: 1, 4: 1 + count, 5: 0}
    assert time.monotonic() - started < 5  # uid 5's counter was created, not waited for


class _StallingStore:
    """A store whose one serving thread stops answering everyone for a while (torch's TCP store
    resolving a connecting peer's name with a slow DNS), then answers this process's requests
    before uid 1's queued beat (`late_s` after the stall): what made a live member "silent"."""

    def __init__(self, late_s: float):
        self._store = dist.HashStore()
        self.late_s, self.until = late_s, 0.0

    def stall(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def _wait(self, late: bool) -> None:
        while time.monotonic() < self.until + (self.late_s if late else 0.0):
            time.sleep(0.005)

    def add(self, key: str, value: int) -> int:
        self._wait(late=key == "hb/1" and value == 1)
        return self._store.add(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(late=False)
        return self._store.multi_get(keys)


@pytest.mark.slow  # over the fast tier's 2 s: it waits out a 2 s stall and a loss
def test_a_store_that_stops_answering_is_nobodys_silence():
    store = _StallingStore(late_s=0.3)
    store.add("uids", 2)
    beats = Heartbeats(store, store, 0, heartbeat_s=0.05, dead_after_s=0.5,
                       members=lambda: [0, 1])
    alive = threading.Event()
    alive.set()

    def member_1() -> None:
        while alive.is_set():
            store.add("hb/1", 1)
            time.sleep(0.05)

    threading.Thread(target=member_1, daemon=True).start()
    beats.start()
    try:
        time.sleep(0.3)
        store.stall(2.0)  # 4x dead_after_s: uid 1's last beat was read before it
        accused, deadline = [], time.monotonic() + 3.0
        while time.monotonic() < deadline:
            accused.append(beats.silent())
            time.sleep(0.01)
        # Without the excuse: "uid 1 silent for ~2.3 s", at the first read after the stall.
        assert accused.count(None) == len(accused), [a for a in accused if a][:3]
        alive.clear()  # now uid 1 is lost for real: found about dead_after_s later
        stopped = time.monotonic()
        while beats.silent() is None:
            assert time.monotonic() - stopped < 2.0, "a lost member was not found"
            time.sleep(0.01)
        assert beats.silent()[0] == 1
    finally:
        alive.clear()
        beats.stop()
