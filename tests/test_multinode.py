"""`ringtrain train --nnodes 2` (through `ringtrain run`) across two hosts: network namespaces
joined by a veth pair.

    .venv/bin/pytest -q tests/test_multinode.py  # root and iproute2; else skips with the reason

Host a (198.18.0.1) runs `ringtrain train --nnodes 2 --node-rank 0 --rdzv-endpoint
198.18.0.1:PORT ...`, host b (198.18.0.2) the same with `--node-rank 1`: each relaunches itself
through `ringtrain run` with one worker. Checked: the run ends
with the same `param_sha256` as 2 processes on one host; SIGKILLing every process of host b
mid-run stops host a within the watchdog bound, naming rank 1; relaunching both hosts on the
same run directory resumes from the last committed snapshot and ends with the same parameters.
Both namespaces share the hostname `vm`, which resolves to 127.0.0.1: the launcher has to find
each host's real address by itself (see `ringtrain.launch.rendezvous._multi_node_addresses`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from netns import Host, reap, two_hosts_or_skip
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ringtrain.launch.failure_report import ChildFailedError, ProcessFailure, format_failure
from ringtrain.launch.launcher import get_args_parser
from ringtrain.launch.peer_failure import PEER_FAILED_EXIT_CODE
from ringtrain.launch.rendezvous import _BoundedRendezvous, _multi_node_addresses

REPO = Path(__file__).resolve().parent.parent
WATCHDOG_S = 5.0  # --watchdog-timeout of the runs below
# Slack over the watchdog timeout for host a to notice, report and reap its worker on a busy
# 2-core machine (measured: ~5 s in all, see test_losing_host_b_stops_host_a_within_the_bound).
EXIT_SLACK_S = 10.0
STEPS, SNAPSHOT_EVERY = 60, 10
TINY = ["--steps", str(STEPS), "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--batch-size", "16", "--eval-every", str(STEPS), "--eval-batch-size", "64",
        "--threads", "1", "--no-progress", "--no-report", "--snapshot-every", str(SNAPSHOT_EVERY),
        "--watchdog-timeout", str(WATCHDOG_S)]
ENV = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | {"PYTHONUNBUFFERED": "1"}
START_S = 90.0  # a launch (two agents, rendezvous, two workers importing torch) on a busy machine


# -- the launcher's multi-node pieces, without namespaces -----------------------------------------

def test_local_addr_defaults_to_the_route_to_the_endpoint():
    args = get_args_parser().parse_args(["--nnodes", "2", "--rdzv-backend", "c10d",
                                         "--rdzv-endpoint", "127.0.0.1:29400", "x.py"])
    _multi_node_addresses(args)
    # The route to a loopback endpoint leaves from 127.0.0.1; torch itself knows it hosts it.
    assert args.local_addr == "127.0.0.1" and not args.rdzv_conf
    args = get_args_parser().parse_args(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400",
                                         "--local-addr", "10.0.0.7", "x.py"])
    _multi_node_addresses(args)
    assert args.local_addr == "10.0.0.7"  # the user's choice stands
    args = get_args_parser().parse_args(["--nproc-per-node", "2", "x.py"])
    _multi_node_addresses(args)
    assert args.local_addr is None  # one node: nothing to advertise


def test_report_leads_with_the_peer_when_every_local_rank_only_stopped(tmp_path):
    error_file = tmp_path / "error.json"
    text = "PeerFailure: rank 1 died (no heartbeat for 3.0 s; last step 12)"
    error_file.write_text(json.dumps({"message": {"message": text, "extraInfo": {
        "py_callstack": text, "timestamp": "1700000000"}}}))
    failure = ProcessFailure(local_rank=0, pid=1000, exitcode=PEER_FAILED_EXIT_CODE,
                             error_file=str(error_file))
    report = format_failure(ChildFailedError("x.py", {0: failure}))
    assert report.startswith("ringtrain run: rank 1 died (no heartbeat for 3.0 s; last step 12); "
                             "rank 0 (local_rank 0, host "), report
    assert report.rstrip().endswith("stopped") and "PeerFailure" not in report


class _StuckStore:
    """A rendezvous handler whose store answers until `vanish` is set, then never again."""

    def __init__(self):
        self.vanish, self.release = threading.Event(), threading.Event()
        self.waiting = 2

    def _call(self, value):
        if self.vanish.is_set():
            self.release.wait(30)  # a TCPStore call to a host that is gone: blocks for minutes
        return value

    def num_nodes_waiting(self):
        return self._call(self.waiting)

    def shutdown(self):
        return self._call(True)

    def get_run_id(self):
        return "job"


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_agent_queries_to_a_vanished_rendezvous_host_are_bounded():
    inner = _StuckStore()
    handler = _BoundedRendezvous(inner, "10.0.0.1:29400", silent_s=1.5, close_s=0.2)
    try:
        assert handler.num_nodes_waiting() == 2 and handler.get_run_id() == "job"
        assert handler.shutdown() is True
        inner.vanish.set()
        started = time.monotonic()
        # While the query hangs the agent gets the last answer and keeps watching its workers...
        assert handler.num_nodes_waiting() == 2
        with pytest.raises(RendezvousConnectionError,
                           match=r"10\.0\.0\.1:29400 did not answer for 1\.5 s"):
            while time.monotonic() - started < 10:
                handler.num_nodes_waiting()  # ...until it has hung for silent_s
        assert time.monotonic() - started < 5
        started = time.monotonic()
        assert handler.shutdown() is False and time.monotonic() - started < 2
    finally:
        inner.release.set()


def test_errors_of_the_rendezvous_query_reach_the_agent():
    class Failing:
        def num_nodes_waiting(self):
            raise RendezvousConnectionError("connection refused")

    with pytest.raises(RendezvousConnectionError, match="connection refused"):
        _BoundedRendezvous(Failing(), "h:1", silent_s=5, close_s=1).num_nodes_waiting()


# -- two hosts ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts():
    with two_hosts_or_skip("two-host tests") as pair:  # removed on exit, also after a failure
        yield pair


@pytest.fixture(scope="module")
def one_host_sha(tmp_path_factory) -> str:
    """param_sha256 of the same run on one host with 2 processes
    (`ringtrain train --nproc-per-node 2`)."""
    run_dir = tmp_path_factory.mktemp("one_host") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=START_S + 60, cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _summary(run_dir)["param_sha256"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _launch(
    hosts: tuple[Host, Host], run_dir: Path, port: int, log_dir: Path
) -> list[subprocess.Popen]:
    """`ringtrain run` on both hosts, node a at the rendezvous endpoint; output in
    log_dir/node{i}.log."""
    run_id = uuid.uuid4().hex[:8]
    procs = []
    for node_rank, host in enumerate(hosts):
        cmd = [sys.executable, "-m", "ringtrain", "train",
               "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
               "--rdzv-id", run_id, "--rdzv-endpoint", f"{hosts[0].addr}:{port}",
               *TINY, "--run-dir", str(run_dir)]
        with open(log_dir / f"node{node_rank}.log", "w") as out:
            procs.append(host.popen(cmd, env=ENV, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _finish(
    procs: list[subprocess.Popen], hosts: tuple[Host, Host], timeout_s: float
) -> list[int | None]:
    """Wait (bounded) for the launchers; kill whatever is left so the next test starts clean."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in procs]
    finally:
        reap(procs, hosts)


def _logs(log_dir: Path) -> str:
    return "\n".join(f"--- node{i} ---\n{(log_dir / f'node{i}.log').read_text()}" for i in range(2))


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1])
                  for p in (run_dir / "snapshots").glob("snap-*/COMMITTED"))


@pytest.mark.multinode
def test_two_hosts_end_with_the_parameters_of_one_host(hosts, one_host_sha, tmp_path):
    run_dir = tmp_path / "run"
    codes = _finish(_launch(hosts, run_dir, 29400, tmp_path), hosts, START_S + 60)
    logs = _logs(tmp_path)
    assert codes == [0, 0], logs
    # Each launcher found its own address (the hostname says 127.0.0.1) and said so.
    for host in hosts:
        assert f"local address {host.addr}" in logs, logs
    summary = _summary(run_dir)
    assert (summary["steps"], summary["world_size"]) == (STEPS, 2)
    assert summary["param_sha256"] == one_host_sha, logs


@pytest.fixture(scope="module")
def host_b_lost(hosts, tmp_path_factory) -> dict:
    """A run whose host b is killed (every process, SIGKILL) after the snapshot of step 10."""
    a, b = hosts
    log_dir = tmp_path_factory.mktemp("host_b_lost")
    run_dir = log_dir / "run"
    procs = _launch(hosts, run_dir, 29401, log_dir)
    try:
        marker = run_dir / "snapshots" / f"snap-{SNAPSHOT_EVERY:08d}" / "COMMITTED"
        deadline = time.monotonic() + START_S
        while not marker.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.01)
        assert marker.exists(), (
            f"no snapshot of step {SNAPSHOT_EVERY} within {START_S:g} s\n{_logs(log_dir)}"
        )
        assert procs[0].poll() is None, f"host a exited before host b was killed\n{_logs(log_dir)}"
        b.kill_all()
        killed_at = time.monotonic()
        try:
            procs[0].wait(timeout=WATCHDOG_S + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            pass
        exit_s = time.monotonic() - killed_at if procs[0].poll() is not None else None
        # The launcher reaps its worker before it returns: nothing of host a may be left.
        left = a.pids()
        took = f"after {exit_s:.2f} s" if exit_s is not None else "not in time"
        print(f"\nhost b killed after step {SNAPSHOT_EVERY}: host a's launcher exited {took} "
              f"(--watchdog-timeout {WATCHDOG_S:g})", flush=True)
        return {"code": procs[0].poll(), "exit_s": exit_s, "left": left, "run_dir": run_dir,
                "logs": _logs(log_dir)}
    finally:
        _finish(procs, hosts, 10)


@pytest.mark.multinode
def test_losing_host_b_stops_host_a_within_the_bound(host_b_lost):
    logs = host_b_lost["logs"]
    assert host_b_lost["exit_s"] is not None, (
        f"host a still running after {WATCHDOG_S + EXIT_SLACK_S:g} s\n{logs}"
    )
    assert host_b_lost["exit_s"] < WATCHDOG_S + EXIT_SLACK_S
    assert host_b_lost["code"] not in (0, None), logs
    assert host_b_lost["left"] == [], logs
    node_a = logs.split("--- node1 ---")[0]
    # Both the worker's watchdog and the launcher's report name the dead rank.
    assert "[rank 0] rank 1 died" in node_a, logs
    assert "ringtrain run: rank 1 died" in node_a, logs


@pytest.mark.multinode
def test_relaunch_resumes_from_the_last_snapshot(hosts, host_b_lost, one_host_sha, tmp_path):
    run_dir = host_b_lost["run_dir"]
    committed = _committed(run_dir)
    assert committed and committed[-1] < STEPS, f"snapshots {committed}: the run was not cut short"
    codes = _finish(_launch(hosts, run_dir, 29402, tmp_path), hosts, START_S + 60)
    logs = _logs(tmp_path)
    assert codes == [0, 0], logs
    step = committed[-1]
    # "resumed from ...: step S of N"
    assert f"snap-{step:08d}: step {step} of {STEPS}" in logs, logs
    summary = _summary(run_dir)
    assert summary["resumed_from_step"] == [step] and summary["steps"] == STEPS
    assert summary["param_sha256"] == one_host_sha, logs
