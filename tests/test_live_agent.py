"""The live agent's decision on each poll (`ringtrain.launch.live_agent`), without processes.

    .venv/bin/pytest -q tests/test_live_agent.py

torch's `SubprocessContext._capture_process_failures` is called on a stand-in context (the
fields the shim reads, processes that only answer `poll()`); starting a replacement is recorded
instead of done. End to end: tests/test_live_train.py, tests/test_chaos.py (`--live`).
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from ringtrain.launch import live_agent, live_spares
from ringtrain.torch_internals import CAPTURE_PROCESS_FAILURES


class _Proc:
    def __init__(self, pid: int, code: int | None = None):
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        assert self.code is not None, "a stand-in process never waited for running"
        return self.code


def _context(*procs: _Proc) -> SimpleNamespace:
    """What torch's poll reads: running local ranks, handlers, envs, failures, error files."""
    return SimpleNamespace(
        _running_local_ranks=set(range(len(procs))), _failures={},
        subprocess_handlers={i: SimpleNamespace(proc=p) for i, p in enumerate(procs)},
        envs={i: {"RANK": str(i)} for i in range(len(procs))},  # no store: nobody departed
        error_files={i: f"/nonexistent/error-{i}.json" for i in range(len(procs))})


@pytest.fixture
def respawned(monkeypatch) -> list[int]:
    started: list[int] = []

    def respawn(context, local_rank, env):
        started.append(local_rank)
        new = _Proc(1000 + local_rank)
        context.subprocess_handlers[local_rank].proc = new
        return new

    monkeypatch.setattr(live_agent, "respawn", respawn)
    return started


def _poll(context) -> None:
    """One poll as torch does it: capture, then drop the workers that ended."""
    done: set[int] = set()
    CAPTURE_PROCESS_FAILURES.get()(context, done)
    context._running_local_ranks.difference_update(done)


def test_a_worker_killed_by_a_signal_is_replaced_and_the_job_goes_on(respawned):
    killed, alive = _Proc(10, -signal.SIGKILL), _Proc(11)
    context = _context(killed, alive)
    with live_agent.replacing_lost_workers():
        _poll(context)
    assert respawned == [0] and context._failures == {}
    assert context.subprocess_handlers[0].proc.pid == 1000


def test_no_replacement_while_the_job_stops_on_an_exception(respawned):
    """A worker raised (exit 1): torch stops the other, SIGKILLs it after its shutdown timeout
    and polls again; that death is the stop's, not a fault to replace."""
    raised, survivor = _Proc(10, 1), _Proc(11)
    context = _context(raised, survivor)
    with live_agent.replacing_lost_workers():
        _poll(context)  # the exception: recorded as the job's failure
        assert set(context._failures) == {0}
        survivor.code = -signal.SIGKILL  # torch's close(): SIGTERM ignored, then SIGKILL
        _poll(context)
    assert respawned == []
    assert {r: f.exitcode for r, f in context._failures.items()} == {0: 1, 1: -signal.SIGKILL}


def test_a_killed_worker_gets_a_waiting_spare_and_a_dead_spare_is_started_again(monkeypatch):
    """--live-spares 1: the spare started on the first poll takes a killed worker's slot (no
    replacement is started for it) and another spare is started; one that dies waiting is too."""
    spawned: list[tuple[dict, _Proc]] = []

    def spawn_like(context, local_rank, env):
        spawned.append((env, _Proc(2000 + len(spawned))))
        return spawned[-1][1]

    monkeypatch.setattr(live_spares, "spawn_like", spawn_like)
    monkeypatch.setattr(live_agent, "respawn", lambda *a: pytest.fail("no respawn with a spare"))
    first, second = _Proc(10), _Proc(11)
    context = _context(first, second)
    with live_agent.replacing_lost_workers(spares=1):
        _poll(context)  # the job started: one spare, marked as one
        assert [env[live_agent.SPARE_ENV] for env, _ in spawned] == ["1"]
        second.code = -signal.SIGKILL
        _poll(context)
        assert context.subprocess_handlers[1].proc is spawned[0][1]  # the spare is rank 1's
        assert len(spawned) == 2 and context._failures == {}  # and a new spare waits
        spawned[1][1].code = -signal.SIGKILL  # that one dies while it waits
        _poll(context)
        assert len(spawned) == 3 and context._failures == {}
        for proc in (first, spawned[0][1], spawned[2][1]):  # the job ends: all exit 0
            proc.code = 0
        _poll(context)
    assert len(spawned) == 3  # none started after the job's end
