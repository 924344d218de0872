"""`ringtrain train --live --nnodes 2` on two network-namespace hosts (gloo, CPU, a tiny GPT).

    .venv/bin/pytest -q tests/test_live_nodes.py                    # root and iproute2, else skips
    RINGTRAIN_FULL=1 .venv/bin/pytest -q tests/test_live_nodes.py   # + a lost link, a lost node 0,
                                                                    # an exception on node 1

Host a (198.18.0.1, node 0: its agent hosts the store) and host b (198.18.0.2, node 1) each run
`ringtrain train --live --nnodes 2 --nproc-per-node 1`, world size 2.
- A kill: rank 1, on host b, kills itself after step 4 (SIGKILL). Host b's agent marks it
  departed and starts its replacement on host b; rank 0 on host a trains every step in the
  process it started in, waits for the replacement (`--live-wait 60`) and heals it over the
  link. The run ends with both launchers' exit 0, the `param_sha256` of a fault-free `--live`
  run on one host (started beside it) and its sample history.
- With RINGTRAIN_FULL=1: host b's link goes down after step 8 (`--live-wait 0`): rank 0 trains
  on alone over the fault-free global batches; host b's agent stops its worker within the
  store's silence bound with one error, no process of host b is left, host a ends with exit 0
  and summary.json without waiting out torch's 300 s exit barrier. And host a vanishes (every
  process killed): host b stops within the same bound, its error saying that a lost node 0 is a
  job restart and how to run it. And rank 1 on host b raises after step 4 (an exception, a
  bug): both launchers exit 1 within seconds, host b with its own failure report, host a with
  one line naming host b's rank, exit code and error; no process is left.
Pure parts (the refusals, the rendezvous answer) run in-process; the agents' store watch and
their poll on a failure: tests/test_live_store.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from netns import Host, reap, two_hosts, two_hosts_or_skip, unavailable
from support.faults import fault_env
from support.live_history import assert_fault_free_history, live_members

from ringtrain.data.addition import train_size
from ringtrain.data.sample_log import SampleLog, check_history
from ringtrain.launch.live_store import STORE_SILENT_S
from ringtrain.launch.rendezvous import _BoundedRendezvous
from ringtrain.live import GlobalBatches

REPO = Path(__file__).resolve().parent.parent
FULL = os.environ.get("RINGTRAIN_FULL") == "1"
STEPS, BATCH, AT = 10, 8, 4
LIVE = ["--nproc-per-node", "1", "--steps", str(STEPS), "--n-layer", "1", "--n-embd", "32",
        "--batch-size", str(BATCH), "--dropout", "0", "--log-every", "2", "--eval-every",
        str(STEPS), "--snapshot-every", str(STEPS), "--threads", "1", "--no-progress",
        "--device", "cpu", "--live", "--record-samples", "--watchdog-timeout", "6",
        "--no-report"]  # report.png is test_live_train's: ~1.3 s of a core a job less
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK", "LOGLEVEL")
ENV = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS} | {"PYTHONUNBUFFERED": "1"}
RUN_S = 240.0  # a whole faulted run (two agents, workers and a replacement importing torch)


# -- in-process: the refusals, the rendezvous answer ---------------------------------------------

def test_live_takes_a_fixed_number_of_nodes_and_refuses_a_range():
    from ringtrain.cli.train_args import check_args, parse_options
    from ringtrain.launch.launcher import launch

    nodes = ["--rdzv-endpoint", "10.0.0.1:29400", "--run-dir", "runs/x", "--nproc-per-node", "2"]
    check_args(parse_options(["--live", "--nnodes", "2", *nodes]), world_size=4)
    with pytest.raises(ValueError, match=r"--live with --nnodes 1:2: live recovery keeps a fixed "
                                         r"set of nodes .* --nnodes 2, or drop --live"):
        check_args(parse_options(["--live", "--nnodes", "1:2", *nodes]), world_size=None)
    with pytest.raises(ValueError, match="a fixed set of nodes; use max_restarts=0 and nnodes='2'"):
        launch("x.py", [], nproc_per_node=2, nnodes="1:2", rdzv_endpoint="h:1", live=True)


def test_a_live_agent_never_restarts_the_workers_for_a_waiting_node():
    class Waiting:
        def __init__(self):
            self.fail = False

        def num_nodes_waiting(self):
            if self.fail:
                raise RuntimeError("connection reset by peer")
            return 1

    inner = Waiting()
    # torch's agent restarts every worker when this is > 0; live, a late node waits outside.
    assert _BoundedRendezvous(inner, "h:1", silent_s=5, close_s=1).num_nodes_waiting() == 1
    live = _BoundedRendezvous(inner, "h:1", silent_s=5, close_s=1, live=True)
    assert live.num_nodes_waiting() == 0
    inner.fail = True  # a lost store host is the live agent's to say (StoreWatch), not torch's
    assert live.num_nodes_waiting() == 0


# -- two hosts ------------------------------------------------------------------------------------

@pytest.fixture
def hosts():
    # One pair per test (~0.2 s): the namespaces' names are the test process's (netns.py), so
    # a module-wide pair still up made the lost-link case's own pair fail to start, and its
    # clean-up removed the shared one (RINGTRAIN_FULL=1 runs both).
    with two_hosts_or_skip("two-host live tests") as pair:  # removed on exit, also after a failure
        yield pair


def _launch(hosts: tuple[Host, Host], run_dir: Path, port: int, extra: list[str],
            env: dict[str, str]) -> list[subprocess.Popen]:
    """`ringtrain train --live --nnodes 2` on both hosts; output in RUN_DIR/../node{i}.log."""
    run_id = uuid.uuid4().hex[:8]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for node, host in enumerate(hosts):
        cmd = [sys.executable, "-m", "ringtrain", "train", "--nnodes", "2", "--node-rank",
               str(node), "--rdzv-id", run_id, "--rdzv-endpoint", f"{hosts[0].addr}:{port}",
               *LIVE, *extra, "--run-dir", str(run_dir)]
        with open(run_dir.parent / f"node{node}.log", "w") as out:
            procs.append(host.popen(cmd, env=env, cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT))
    return procs


def _logs(run_dir: Path) -> list[str]:
    return [(run_dir.parent / f"node{i}.log").read_text() for i in range(2)]


def _history(run_dir: Path) -> SampleLog:
    shared = torch.load(run_dir / "snapshots" / f"snap-{STEPS:08d}" / "shared.pt",
                        weights_only=True)
    return SampleLog.from_state(shared["trainer"]["samples"])


@pytest.mark.multinode
def test_a_worker_killed_on_node_b_is_replaced_there_and_the_run_is_the_fault_free_one(
        hosts, tmp_path):
    a, b = hosts
    clean_dir, run_dir = tmp_path / "clean" / "run", tmp_path / "faulted" / "run"
    clean_dir.parent.mkdir(parents=True)
    # The fault-free reference, one host, started beside it (it mostly waits for the other).
    clean = subprocess.Popen([sys.executable, "-m", "ringtrain", "train", *LIVE,
                              "--nproc-per-node", "2", "--live-wait", "60", "--run-dir",
                              str(clean_dir)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    procs = _launch(hosts, run_dir, 29470, ["--live-wait", "60"],
                    ENV | fault_env(f"kill:1:{AT}"))
    try:
        codes = [p.wait(timeout=RUN_S) for p in procs]
        clean_out = clean.communicate(timeout=RUN_S)[0]
        left = a.pids() + b.pids()
    finally:
        reap([*procs, clean], hosts)
    node_a, node_b = logs = _logs(run_dir)
    assert codes == [0, 0], "\n".join(logs)
    assert clean.returncode == 0, clean_out[-3000:]
    assert left == [], f"left behind: {left}"
    members = {(m["launcher_rank"], m["joined_at_step"]): m for m in live_members(run_dir)}
    assert set(members) == {(0, 0), (1, 0), (1, AT)}, members
    survivor, killed, replacement = members[0, 0], members[1, 0], members[1, AT]
    # Rank 0 trained every step in the process it started in; rank 1 died after step 4 and
    # its replacement, healed from rank 0 over the link, trained the rest.
    assert survivor["status"] == "finished" and survivor["step"] == STEPS, survivor
    assert killed["status"] == "training", killed
    assert replacement["status"] == "finished" and replacement["step"] == STEPS, replacement
    assert survivor["members"] == replacement["members"] == 2
    # Host b's agent found the death and started the replacement there; host a's did nothing.
    said = (f"rank 1 (pid {killed['pid']}) killed by SIGKILL; the others go on, replacement 1 "
            f"of at most 32 started (pid {replacement['pid']}, forked from the warm process)")
    assert said in node_b, node_b[-3000:]
    assert "ringtrain run: live:" not in node_a, node_a[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    reference = json.loads((clean_dir / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (STEPS, 2)
    assert summary["param_sha256"] == reference["param_sha256"]
    assert_fault_free_history(_history(run_dir), _history(clean_dir), steps=STEPS,
                              global_batch=BATCH * 2)


RAISE_STEPS = 40  # host a, alone, would train these to the end and exit 0 were it not stopped
RAISE_STOP_S = 10.0  # the failure read within a poll, then torch's SIGTERM shutdown


@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.parametrize("node", [1, 0], ids=["on_node_1", "on_node_0_the_stores_host"])
def test_an_exception_on_one_node_stops_the_job_on_every_node(hosts, tmp_path, node):
    if not FULL:
        pytest.skip("RINGTRAIN_FULL=1 runs the exception case (~20 s); the in-process tests "
                    "cover the failure record and its reading")
    other = 1 - node  # one worker per node: the failed rank is the node's number
    run_dir = tmp_path / "run"
    # --live-wait 0: the other node's member regroups without the failed one at once, and
    # would train on alone.
    procs = _launch(hosts, run_dir, 29473 + node, ["--live-wait", "0", "--steps",
                                                   str(RAISE_STEPS), "--eval-every",
                                                   str(RAISE_STEPS)],
                    ENV | fault_env(f"raise:{node}:{AT}"))
    try:
        exited: dict[int, float] = {}
        deadline = time.monotonic() + RUN_S
        while len(exited) < 2 and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.time()  # unix time: the fault prints the raise's
            time.sleep(0.05)
        left = hosts[0].pids() + hosts[1].pids()
    finally:
        reap(procs, hosts)
    logs = _logs(run_dir)
    failed, stopped = logs[node], logs[other]
    assert [p.returncode for p in procs] == [1, 1], "\n".join(logs)
    assert left == [], f"left behind: {left}"
    error = f"RuntimeError: RINGTRAIN_TEST_FAULT: an exception raised on rank {node} after " \
            f"step {AT}"
    # The failed node reports its own worker's failure, as on one node; the other names it, once.
    assert f"ringtrain run: rank {node} failed (local_rank 0, host " in failed, failed[-3000:]
    assert "ringtrain run: live:" not in failed, failed[-3000:]
    said = re.findall(rf"ringtrain run: live: node {node} \(host [^)]+\): rank {node} "
                      r"\(local_rank 0, pid \d+\) exited with exit code 1: (.*)\. A worker's "
                      r"failure is the job's on every node", stopped)
    assert said == [error], stopped[-3000:]
    assert f"stopped this node's workers (node {other}, ranks [{other}]). Fix the cause and run " \
           "the same command again on every node; it resumes from the last snapshot" in stopped
    raised = float(re.search(r"test fault: raise after step \d+ at unix time ([\d.]+)",
                             failed)[1])
    print(f"\nan exception on node {node}: its launcher exited after "
          f"{exited[node] - raised:.1f} s, node {other}'s after {exited[other] - raised:.1f} s",
          flush=True)
    assert max(exited.values()) - raised < RAISE_STOP_S
    # The other node's member stopped at about the failed step, not after training on alone.
    assert not (run_dir / "summary.json").exists()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines() if line.strip()]
    assert max(steps, default=0) < RAISE_STEPS, steps


# -- two hosts, RINGTRAIN_FULL=1: a lost link, a lost node 0 --------------------------------------

LINK_STEPS, CUT_AFTER = 40, 8
STOP_SLACK_S = 15.0  # over the store's silence bound: a poll, the kill, the rendezvous's close


def _cut(run_dir: Path, port: int, cut) -> dict:
    """A run (--live-wait 0) on two fresh hosts in which `cut(hosts)` happens once step
    CUT_AFTER is logged (fresh: a link taken down stays down)."""
    reason = unavailable()
    if reason:
        pytest.skip(f"two-host live tests need network namespaces: {reason}")
    with two_hosts() as hosts:
        return _cut_on(hosts, run_dir, port, cut)


def _cut_on(hosts: tuple[Host, Host], run_dir: Path, port: int, cut) -> dict:
    procs = _launch(hosts, run_dir, port, ["--live-wait", "0", "--steps", str(LINK_STEPS),
                                           "--eval-every", str(LINK_STEPS), "--snapshot-every",
                                           str(LINK_STEPS)], ENV)
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + RUN_S
        while not (metrics.exists() and any(json.loads(line)["step"] >= CUT_AFTER for line in
                                            metrics.read_text().splitlines() if line.strip())):
            assert time.monotonic() < deadline and procs[0].poll() is None, _logs(run_dir)
            time.sleep(0.02)
        cut(hosts)
        cut_at = time.monotonic()
        exited: dict[int, float] = {}
        while len(exited) < 2 and time.monotonic() - cut_at < RUN_S:
            for i, p in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.monotonic() - cut_at
                    if i == 1:
                        left_b = hosts[1].pids()  # right after its launcher, before the reap
            time.sleep(0.05)
        return {"codes": [p.poll() for p in procs], "exit_s": exited, "logs": _logs(run_dir),
                "left_b": left_b if 1 in exited else None}
    finally:
        reap(procs, hosts)


@pytest.mark.multinode
@pytest.mark.slow
def test_a_node_that_loses_its_link_stops_and_the_others_train_on(tmp_path):
    if not FULL:
        pytest.skip("RINGTRAIN_FULL=1 runs the lost-link case (~45 s); the kill case covers "
                    "the multi-node launcher by default")
    run_dir = tmp_path / "run"
    out = _cut(run_dir, 29471, lambda h: h[1].unplug())
    node_a, node_b = out["logs"]
    assert out["codes"] == [0, 1], "\n".join(out["logs"])
    print(f"\nlink down after step {CUT_AFTER}: node 1 stopped after {out['exit_s'][1]:.1f} s, "
          f"node 0 finished after {out['exit_s'][0]:.1f} s", flush=True)
    assert out["exit_s"][1] < STORE_SILENT_S + STOP_SLACK_S
    assert out["left_b"] == [], out["left_b"]
    assert "node 1 lost the job's store at 198.18.0.1:" in node_b, node_b[-3000:]
    assert "Stopped this node's workers (ranks [1])" in node_b, node_b[-3000:]
    assert "not waiting for node 1" in node_a, node_a[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == LINK_STEPS and summary["world_size"] == 1
    survivor = next(m for m in live_members(run_dir) if m["launcher_rank"] == 0)
    assert survivor["status"] == "finished" and survivor["recoveries"] == 1, survivor
    # Trained on alone, but over the fault-free run's global batches, each sample once.
    shared = torch.load(run_dir / "snapshots" / f"snap-{LINK_STEPS:08d}" / "shared.pt",
                        weights_only=True)
    history = SampleLog.from_state(shared["trainer"]["samples"])
    n = train_size(2)
    report = check_history(history, dataset_len=n, seed=1337, global_batch=BATCH * 2,
                           steps=LINK_STEPS)
    assert report["errors"] == [], report["errors"]
    batches = GlobalBatches(n, BATCH * 2, seed=1337)
    assert history.step_sets() == {s + 1: sorted((0, i) for i in batches.batch(s))
                                   for s in range(LINK_STEPS)}


@pytest.mark.multinode
@pytest.mark.slow
def test_a_lost_node_0_is_a_job_restart_and_node_1_says_so(tmp_path):
    if not FULL:
        pytest.skip("RINGTRAIN_FULL=1 runs the lost-node-0 case (~40 s)")
    out = _cut(tmp_path / "run", 29472, lambda h: h[0].kill_all())
    node_b = out["logs"][1]
    assert out["codes"][1] == 1, node_b[-3000:]
    assert out["exit_s"][1] < STORE_SILENT_S + STOP_SLACK_S
    assert out["left_b"] == [], out["left_b"]
    assert "If node 0 or its agent is gone, the job is lost: run the same command again on " \
           "every node; it resumes from the last snapshot" in node_b, node_b[-3000:]
