"""The live agents' line to the job's store across nodes (`ringtrain.launch.live_store`).

    .venv/bin/pytest -q tests/test_live_store.py

Several `StoreWatch`es (one per node's agent) on one local TCPStore, no process and no network
namespace: members matched by launcher rank and pid, the exit barrier giving up on a silent
agent, a silent store holding every decision, and a worker failure that is the job's: its
record written once (the first wins) and read by every other agent before the failed node's
agent lets torch stop its workers. The agent's poll (`ringtrain.launch.live_agent`) runs on a
stand-in for torch's process context. The same on two network-namespace hosts, end to end:
tests/test_live_nodes.py.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ringtrain.launch.live_store import StoreWatch


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    yield server


@pytest.fixture(autouse=True)
def _agents_with_room(monkeypatch):
    """The agent's own watch (built inside `replacing_lost_workers`) with room for a loaded
    machine: these tests are about what an agent decides, not about its bounds, and on 2 cores
    beside the live tests' process starts its client store once failed to connect twice in a
    row (5 s each: "silent" after 10 s, `LiveStoreLostError`). The bounds themselves are tested
    with watches of their own (`silent_after_s=1.0` below)."""
    import ringtrain.launch.live_agent as agent

    class Roomy(StoreWatch):
        def __init__(self, *args, silent_after_s: float = 60.0, **kwargs):
            super().__init__(*args, silent_after_s=silent_after_s, **kwargs)

        def fail(self, record: dict, bound_s: float = 30.0) -> dict | None:
            return super().fail(record, bound_s)

    monkeypatch.setattr(agent, "StoreWatch", Roomy)


def _envs(port: int, node: int, ranks: list[int], nodes: int = 2) -> dict[int, dict[str, str]]:
    return {local: {"RANK": str(r), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
            for local, r in enumerate(ranks)}


def _live_keys(server) -> dist.Store:
    return dist.PrefixStore("ringtrain/job/attempt_0/ringtrain/live/train", server)


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s"
        time.sleep(0.02)


def test_each_agent_reads_and_marks_only_its_own_nodes_members_by_pid(store):
    keys = _live_keys(store)
    # The same pid on both machines: rank 0's process on node 0, rank 1's on node 1.
    for uid, slot in ((0, 0), (1, 1)):
        keys.add("uids", 1)
        keys.set(f"pid/{uid}", "4242")
        keys.set(f"slot/{uid}", str(slot))
    watches = [StoreWatch(poll_s=0.02), StoreWatch(poll_s=0.02)]
    try:
        for node, watch in enumerate(watches):
            watch.start(_envs(store.port, node, [node]))
        keys.set("departed/1", b"1")  # node 1's member declared lost by its peers
        found: list[int] = []
        _until(lambda: bool(found.extend(watches[1].pids()) or found))
        assert found == [4242] and watches[0].pids() == []  # node 0 kills nothing of its own
        watches[0].mark(4242)  # node 0's process 4242 exited: its uid, not node 1's
        _until(lambda: keys.check(["departed/0"]))
        assert watches[1].pids() == []
    finally:
        for watch in watches:
            watch.close()


def test_the_exit_barrier_waits_for_live_agents_and_gives_up_on_a_silent_one(store):
    watches = [StoreWatch(poll_s=0.02, silent_after_s=1.0) for _ in range(3)]
    try:
        for node, watch in enumerate(watches):
            watch.start(_envs(store.port, node, [node], nodes=3))
        _until(lambda: all(_live_keys(store).check([f"agents/{n}/beat"]) for n in range(3)))
        watches[2].close()  # node 2's agent stops beating (stopped itself, or its host is gone)
        out: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda n=n: out.setdefault(n, watches[n].finish()))
                   for n in (0, 1)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert out == {0: [2], 1: [2]}
        assert 0.5 < time.monotonic() - started < 5  # about silent_after_s, not torch's 300 s
    finally:
        for watch in watches:
            watch.close()


def test_a_nodes_failure_is_written_once_and_read_by_every_other_agent(store):
    watches = [StoreWatch(poll_s=0.02) for _ in range(3)]
    try:
        for node, watch in enumerate(watches):
            watch.start(_envs(store.port, node, [node], nodes=3))
        _until(lambda: all(_live_keys(store).check([f"agents/{n}/beat"]) for n in range(3)))
        assert [w.failure() for w in watches] == [None] * 3
        record = {"host": "b", "rank": 1, "exitcode": 1, "error": "RuntimeError: bug"}
        started = time.monotonic()
        # Node 1 returns once nodes 0 and 2 have read it (before it stops its own workers).
        assert watches[1].fail(record) == record | {"node": 1}
        assert time.monotonic() - started < 3
        assert all(_live_keys(store).check([f"agents/{n}/seen_failed"]) for n in (0, 2))
        assert watches[0].failure() == watches[2].failure() == record | {"node": 1}
        assert [w.failure() for w in watches] == [None] * 3  # once each; never its own
        # A second failure (node 2's worker, stopped meanwhile) does not replace the first.
        assert watches[2].fail(record | {"rank": 2}) == record | {"node": 1}
        assert json.loads(_live_keys(store).get("failed")) == record | {"node": 1}
    finally:
        for watch in watches:
            watch.close()


def test_a_failed_node_stops_its_workers_without_waiting_for_a_silent_agent(store):
    watches = [StoreWatch(poll_s=0.02) for _ in range(2)]
    try:
        for node, watch in enumerate(watches):
            watch.start(_envs(store.port, node, [node]))
        _until(lambda: _live_keys(store).check(["agents/0/beat", "agents/1/beat"]))
        watches[0].close()  # node 0's agent never reads the record (cut off)
        started = time.monotonic()
        assert watches[1].fail({"rank": 1}, bound_s=0.5) == {"rank": 1, "node": 1}
        assert 0.4 < time.monotonic() - started < 3  # about bound_s, then it stops anyway
    finally:
        for watch in watches:
            watch.close()


def test_a_failed_workers_record_names_it_and_what_it_raised(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from ringtrain.launch.live_agent import _failed_elsewhere, _failure_record

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:  # written as a worker under @record writes it
        raise RuntimeError("bad shape (4, 3)\nsecond line")
    except RuntimeError as e:
        ErrorHandler().record_exception(e)

    class Exited:  # a worker process that exited with 1
        pid, returncode = 4242, 1

        def poll(self) -> int:
            return self.returncode

    class Context:  # torch's SubprocessContext: the workers' environments
        envs = {0: {"RANK": "3", "TORCHELASTIC_ERROR_FILE": str(error_file)}}

    record = _failure_record(Context(), 0, 3, Exited())
    assert record | {"host": "h"} == {"host": "h", "rank": 3, "local_rank": 0, "pid": 4242,
                                      "exitcode": 1, "error": "RuntimeError: bad shape (4, 3)"}
    Context.envs[0]["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / "none.json")  # none written
    assert _failure_record(Context(), 0, 3, Exited())["error"] == ""
    said = _failed_elsewhere(0, record | {"node": 1, "host": "b"}, [3])
    assert said == (
        "node 1 (host b): rank 3 (local_rank 0, pid 4242) exited with exit code 1: RuntimeError: "
        "bad shape (4, 3). A worker's failure is the job's on every node (the same error would "
        "end any replacement): stopped this node's workers (node 0, ranks [3]). Fix the cause "
        "and run the same command again on every node; it resumes from the last snapshot")


class _Worker:  # a worker process as the agent's poll reads it: running (None) or exited
    def __init__(self, pid: int, code: int | None = None):
        self.pid, self.returncode = pid, code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def _agent_poll(port: int, node: int, worker: _Worker):
    """A stand-in for torch's SubprocessContext on `node` (one worker, rank = node), and one
    poll of torch's agent on it: the capture `replacing_lost_workers` patched in, as torch's."""
    from types import SimpleNamespace

    from ringtrain.torch_internals import CAPTURE_PROCESS_FAILURES

    context = SimpleNamespace(_running_local_ranks={0}, _failures={},
                              subprocess_handlers={0: SimpleNamespace(proc=worker)},
                              envs=_envs(port, node, [node]),
                              error_files={0: "/nonexistent/error.json"})

    def poll() -> bool:
        done: set[int] = set()
        CAPTURE_PROCESS_FAILURES.get()(context, done)
        context._running_local_ranks.difference_update(done)
        return bool(context._failures)
    return context, poll


def test_a_failed_nodes_agent_has_its_record_read_before_torch_stops_its_workers(store):
    from ringtrain.launch.live_agent import replacing_lost_workers

    other = StoreWatch(poll_s=0.02)  # node 0's agent
    raised = _Worker(4242)
    context, poll = _agent_poll(store.port, 1, raised)
    try:
        other.start(_envs(store.port, 0, [0]))
        with replacing_lost_workers():
            poll()  # the watch starts
            _until(lambda: _live_keys(store).check(["agents/0/beat", "agents/1/beat"]))
            raised.returncode = 1  # an exception
            _until(poll)  # judged once the store answered since; then torch's failure
            # By then node 0's agent has read the record (node 1's agent waited for it).
            assert _live_keys(store).check(["agents/0/seen_failed"])
        assert set(context._failures) == {0}
        record = other.failure()
        assert record is not None and record | {"host": "h"} == {
            "node": 1, "host": "h", "rank": 1, "local_rank": 0, "pid": 4242, "exitcode": 1,
            "error": ""}  # no error file here
    finally:
        other.close()


def test_an_agent_stops_its_workers_on_another_nodes_failure(store):
    from ringtrain.launch.live_agent import LiveJobFailedError, replacing_lost_workers

    context, poll = _agent_poll(store.port, 0, _Worker(4343))
    with replacing_lost_workers():
        poll()
        _live_keys(store).set("failed", json.dumps({
            "node": 1, "host": "b", "rank": 1, "local_rank": 0, "pid": 4242, "exitcode": 1,
            "error": "RuntimeError: bug"}))
        with pytest.raises(LiveJobFailedError) as e:  # torch's agent then stops the workers
            _until(poll)
    assert context._failures == {}  # none of its own: the message is the report
    assert str(e.value).startswith("node 1 (host b): rank 1 (local_rank 0, pid 4242) exited "
                                   "with exit code 1: RuntimeError: bug. ")
    assert "stopped this node's workers (node 0, ranks [0])" in str(e.value)


def test_a_node_that_finished_exits_with_another_nodes_failure_not_waiting_for_it(store):
    from ringtrain.launch.live_agent import LiveJobFailedError, replacing_lost_workers
    from ringtrain.torch_internals import EXIT_BARRIER

    keys = _live_keys(store)
    worker = _Worker(4343)
    _, poll = _agent_poll(store.port, 0, worker)
    with replacing_lost_workers():
        poll()
        worker.returncode = 0  # node 0's workers finished; node 1's rank 1 then raised
        poll()
        keys.set("failed", json.dumps({"node": 1, "host": "b", "rank": 1, "local_rank": 0,
                                       "pid": 4242, "exitcode": 1, "error": ""}))
        _until(lambda: keys.check(["agents/0/seen_failed"]))
        started = time.monotonic()
        with pytest.raises(LiveJobFailedError, match=r"node 1 \(host b\): rank 1 .* this "
                                                     r"node's workers \(node 0\) had finished"):
            EXIT_BARRIER.get()(None)  # node 1 never says done: not waited for
        assert time.monotonic() - started < 3


def test_a_silent_store_holds_every_decision_and_is_timed():
    watch = StoreWatch(poll_s=0.02)
    with socket_without_server() as port:
        try:
            watch.start(_envs(port, 1, [1]))
            time.sleep(0.5)
            assert watch.silent_s() >= 0.5
            # An exited worker is judged only once the store answered after it exited.
            assert not watch.answered_since([1234])
        finally:
            watch.close()


class socket_without_server:  # noqa: N801 (a context manager read as a noun)
    """A local port nobody listens on, held bound so no one else takes it meanwhile."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
