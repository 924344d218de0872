"""Dead-rank watchdog: a dead, frozen or raising rank is named, within the bound, by every other.

    .venv/bin/pytest -q tests/test_watchdog.py

The first tests drive two watchdogs on one in-process store (no processes). The rest run gloo
ranks through `run_workers` with timeout_s=3: a rank SIGKILLed or SIGSTOPped (frozen, sockets
open: what a vanished host looks like) while the others are blocked in an all-reduce or
computing, a rank that raises, and the rank that hosts the store frozen. Each survivor's
`on_dead` writes what it found and when to a file, then exits as the default does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringtrain.errors import is_connection_lost
from ringtrain.launch.peer_failure import PEER_FAILED_EXIT_CODE, PeerFailure, exit_on_peer_failure
from ringtrain.launch.watchdog import Watchdog
from ringtrain.testing import WorkerError, run_workers

GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:64185: Connection reset by peer. This is typically caused by a remote "
              "worker hanging or bugs in the application.")


def _pair(store, **kw):
    kw = {"interval_s": 0.05, "timeout_s": 0.5, "prefix": "t", "excepthook": False, **kw}
    found: list[PeerFailure] = []
    w0 = Watchdog(store, 0, 2, on_dead=found.append, **kw).start()
    w1 = Watchdog(store, 1, 2, on_dead=lambda f: None, **kw).start()
    return w0, w1, found


def _wait(found: list, timeout_s: float) -> float:
    start = time.monotonic()
    while not found and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
    return time.monotonic() - start


def test_arguments_are_checked():
    with pytest.raises(ValueError,
                       match=r"interval_s=2, timeout_s=1: need 0 < interval_s < timeout_s"):
        Watchdog(dist.HashStore(), 0, 2, interval_s=2, timeout_s=1)
    with pytest.raises(ValueError,
                       match=r"Invalid rank 2, rank should be in the interval \[0, 1\]"):
        Watchdog(dist.HashStore(), 2, 2)
    Watchdog(dist.HashStore(), 0, 1).start().stop()  # one process: nothing to watch


def test_silent_peer_is_named_with_its_last_step():
    w0, w1, found = _pair(dist.HashStore())
    w1.set_step(12)
    assert _wait(found, 0.3) >= 0.3 and found == []  # both beating: nobody is dead
    w1.stop(done=False)  # rank 1 "dies": its heartbeats stop, no goodbye
    _wait(found, 5)
    w0.stop()
    assert found[0].kind == "died" and found[0].rank == 1
    assert str(found[0]).startswith("rank 1 died (no heartbeat for ")
    assert str(found[0]).endswith("; last step 12)")


def test_finished_peer_is_not_dead():
    w0, w1, found = _pair(dist.HashStore())
    w1.stop()  # done
    assert _wait(found, 1.5) >= 1.5 and found == []
    w0.stop()


def test_raising_peer_is_named_at_once():
    w0, w1, found = _pair(dist.HashStore(), timeout_s=30)
    w1.set_step(7)
    w1.report_failure(ValueError("boom\nsecond line"))
    took = _wait(found, 5)
    w0.stop(), w1.stop(done=False)
    assert str(found[0]) == "rank 1 failed at step 7: ValueError: boom"
    assert took < 1.0  # a store read away, not a timeout


def _raised(message: str) -> tuple[type, BaseException, object]:
    try:
        raise RuntimeError(message)  # one line: every rank's traceback the same text
    except RuntimeError as e:
        return type(e), e, e.__traceback__


def test_ranks_raising_the_same_error_print_its_traceback_once(capsys, monkeypatch):
    """A model's mistake raises on every rank: the first rank prints the traceback, the others
    one line naming it; another message is printed in full; a first rank that never finishes
    its print (killed) leaves the others to print theirs, after traceback_once.WAIT_S."""
    import ringtrain.launch.traceback_once as once

    store = dist.HashStore()
    dogs = [Watchdog(store, r, 4, prefix="tb", timeout_s=5) for r in range(4)]  # not started
    same = _raised("mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)")
    dogs[2]._hook(*same)
    dogs[0]._hook(*same)
    dogs[1]._hook(*_raised("rank 1 has bad data"))
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 2, err
    assert err.count("RuntimeError: mat1 and mat2 shapes") == 2, err
    assert ("[rank0]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2) (the "
            "same traceback as rank 2's, printed in its output)") in err.splitlines()
    assert "RuntimeError: rank 1 has bad data" in err
    monkeypatch.setattr(once, "WAIT_S", 0.2)
    lost = _raised("its first printer was killed")
    assert once.claim_traceback(dogs[0]._store, 0, "".join(traceback.format_exception(*lost))) == 0
    started = time.monotonic()  # rank 0 claimed it and never said it was out
    dogs[3]._hook(*lost)
    assert 0.2 <= time.monotonic() - started < 2
    assert "Traceback" in capsys.readouterr().err

    class Gone:  # the store's host died with the first rank
        def compare_set(self, *args):
            raise RuntimeError("Connection reset by peer")

    assert once.claim_traceback(Gone(), 0, "any") is None  # each rank prints its own


def test_ringtrain_train_workers_print_a_shared_traceback_once_and_exit_without_again(capsys):
    """`ringtrain train`'s workers print what the training raised themselves (not through an
    excepthook: the watchdog is gone by then): the same rule, `[rank N] ` as their log says it,
    and their exit (launch/ending.py) does not print it a second time."""
    from types import SimpleNamespace

    from ringtrain.cli.worker import _print_traceback_once
    from ringtrain.launch.ending import exit_code

    store = dist.HashStore()
    errors = []
    for rank in (1, 0):
        _, exc, _ = _raised("my metric logger failed at step 3")
        _print_traceback_once(exc, SimpleNamespace(rank=rank, world_size=2, store=store))
        errors.append(exc)
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.endswith("[rank 0] RuntimeError: my metric logger failed at step 3 (the same "
                        "traceback as rank 1's, printed in its output)\n"), err

    def raises():
        raise errors[0]
    assert exit_code(raises) == 1 and capsys.readouterr().err == ""


def test_lost_connection_waits_for_the_watchdog_to_name_the_peer():
    # gloo's error names a socket; report_failure holds it back until the silent rank is known,
    # with the short "suspect" bound instead of timeout_s (30 s here).
    w0, w1, found = _pair(dist.HashStore(), timeout_s=30)
    time.sleep(0.2)
    w1.stop(done=False)
    start = time.monotonic()
    w0.report_failure(RuntimeError(GLOO_RESET))
    took = time.monotonic() - start
    w0.stop()
    assert found and found[0].rank == 1 and found[0].kind == "died"
    assert w0.failure == found[0]
    assert took < w0.suspect_timeout_s + 2.0


def test_a_tolerated_peer_is_dropped_and_the_watch_goes_on():
    # Rank 0 tolerates ranks 1 and 2: their deaths go to on_departed, not on_dead. Rank 1
    # raises (named at once), rank 2 goes silent (named after timeout_s).
    store, kw = dist.HashStore(), {"interval_s": 0.05, "timeout_s": 0.5, "prefix": "t",
                                   "excepthook": False}
    found, departed = [], []
    w0 = Watchdog(store, 0, 3, on_dead=found.append, tolerate={1, 2},
                  on_departed=departed.append, **kw).start()
    w1 = Watchdog(store, 1, 3, on_dead=lambda f: None, **kw).start()
    w2 = Watchdog(store, 2, 3, on_dead=lambda f: None, **kw).start()
    w1.report_failure(ValueError("boom"))
    w1.stop(done=False)
    w2.stop(done=False)
    deadline = time.monotonic() + 5
    while len(departed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the watch goes on: nothing fires, nothing is reported twice
    w0.stop()
    assert found == [] and w0.failure is None
    assert sorted((f.rank, f.kind) for f in departed) == [(1, "failed"), (2, "died")]


def test_an_untolerated_peer_still_stops_a_tolerant_watch():
    found: list[PeerFailure] = []
    kw = {"interval_s": 0.05, "timeout_s": 0.5, "prefix": "t", "excepthook": False}
    store = dist.HashStore()
    w0 = Watchdog(store, 0, 2, on_dead=found.append, tolerate={5}, **kw).start()
    w1 = Watchdog(store, 1, 2, on_dead=lambda f: None, **kw).start()
    w1.stop(done=False)
    _wait(found, 5)
    w0.stop()
    assert found and found[0].rank == 1 and found[0].kind == "died"


def test_connection_lost_classifier():
    assert is_connection_lost(RuntimeError(GLOO_RESET))
    assert is_connection_lost(
        "RuntimeError: [gloo/transport/tcp] Connection closed by peer [::1]:5"
    )
    assert not is_connection_lost(ValueError("Connection reset by peer"))  # user code, not comms
    assert not is_connection_lost(RuntimeError("CUDA out of memory"))


# -- real processes -------------------------------------------------------------------------------

def _survivor_writes(rank: int, out_dir: str):
    def on_dead(failure: PeerFailure) -> None:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"kind": failure.kind, "rank": failure.rank, "text": str(failure), "t": time.time()}))
        exit_on_peer_failure(rank, failure)  # the default: one line on stderr, os._exit(75)
    return on_dead


def _scenario(rank, world_size, victim, how, compute_ranks, timeout_s, out_dir):
    """Every rank all-reduces or computes in a loop; `victim` does `how` at step 3."""
    torch.manual_seed(rank)
    watchdog = Watchdog(name="scenario", interval_s=0.25, timeout_s=timeout_s, excepthook=False,
                        on_dead=_survivor_writes(rank, out_dir)).start()
    x, a = torch.ones(1), torch.randn(64, 64)
    dist.all_reduce(x)
    # With ranks that compute, the others all-reduce in a group of their own and the victim:
    # a world all-reduce that a computing rank never enters would rightly be named a hang of
    # that rank, racing the victim's verdict.
    group = None
    if compute_ranks:
        group = dist.new_group([r for r in range(world_size) if r not in compute_ranks
                                or r == victim])
    time.sleep(0.5)  # everyone has seen everyone's heartbeat
    try:
        deadline = time.monotonic() + 30
        step = 0
        while time.monotonic() < deadline:
            watchdog.set_step(step)
            if rank == victim and step == 3:
                Path(out_dir, "victim").write_text(str(time.time()))
                if how == "raise":
                    try:
                        raise ValueError("boom")
                    except ValueError as e:
                        watchdog.report_failure(e)
                        time.sleep(3)  # linger, so run_workers does not stop the others first
                        raise
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            if rank in compute_ranks:
                a = torch.tanh(a @ a)  # (64, 64)
                time.sleep(0.01)
            else:
                dist.all_reduce(x, group=group)
            step += 1
    except BaseException as e:
        watchdog.report_failure(e)  # a lost connection waits here for the watchdog's verdict
        raise
    return "survived"


def _run(tmp_path, world_size, victim, how, compute_ranks=(), timeout_s=3.0):
    with pytest.raises(WorkerError):
        run_workers(_scenario, world_size, (victim, how, tuple(compute_ranks), timeout_s,
                                            str(tmp_path)), timeout_s=60)
    failed_at = float((tmp_path / "victim").read_text())
    found = {}
    for rank in range(world_size):
        if rank != victim:
            path = tmp_path / f"rank{rank}.json"
            assert path.exists(), f"rank {rank} did not report rank {victim}'s failure"
            found[rank] = json.loads(path.read_text())
            found[rank]["after_s"] = found[rank]["t"] - failed_at
    return found


def test_sigkill_during_allreduce_named_fast(tmp_path):
    # gloo raises "Connection reset/closed by peer" at once; the watchdog turns that into a name
    # within its suspect bound (1 s here), far below timeout_s.
    found = _run(tmp_path, 2, victim=1, how="kill", timeout_s=10.0)
    assert found[0]["rank"] == 1 and found[0]["kind"] == "died", found
    assert found[0]["after_s"] < 5.0, found


def test_frozen_rank_named_by_ranks_blocked_in_allreduce_and_computing(tmp_path):
    # SIGSTOP: no error ever reaches rank 0's all-reduce; rank 1 is not in a collective at all.
    found = _run(tmp_path, 3, victim=2, how="stop", compute_ranks=(1, 2))
    for rank in (0, 1):
        assert found[rank]["rank"] == 2 and found[rank]["kind"] == "died", found
        # About timeout_s (3 s); a rank whose connection to a peer that exited on its verdict
        # was lost switches to the suspect bound and may name rank 2 a beat earlier.
        age = float(re.match(r"rank 2 died \(no heartbeat for ([\d.]+) s", found[rank]["text"])[1])
        assert 2.0 <= age < 4.5, found
        # The step as last published; a rank may quote the verdict the other one shared first.
        assert re.search(r"; last step [0-3](; seen by rank [01])?\)$", found[rank]["text"]), found
        # Silence counts from the last change seen.
        assert 2.5 <= found[rank]["after_s"] < 10.0, found


def test_raising_rank_named_by_rank_blocked_in_allreduce(tmp_path):
    found = _run(tmp_path, 2, victim=1, how="raise", timeout_s=10.0)
    assert found[0]["text"] == "rank 1 failed at step 3: ValueError: boom", found
    assert found[0]["after_s"] < 2.0, found


def test_frozen_store_host_is_named(tmp_path):
    # run_workers' rendezvous store lives in rank 0's process: freezing rank 0 freezes the store.
    found = _run(tmp_path, 2, victim=0, how="stop", compute_ranks=(0, 1))
    assert found[1]["kind"] == "store" and found[1]["rank"] == 0, found
    assert "lost the rendezvous store at 127.0.0.1:" in found[1]["text"], found
    assert "rank 0's process" in found[1]["text"], found
    assert 2.5 <= found[1]["after_s"] < 10.0, found  # silence counts from the last good read


def test_exit_code_is_distinct():
    assert PEER_FAILED_EXIT_CODE not in (0, 1, 2) and 0 < PEER_FAILED_EXIT_CODE < 128
