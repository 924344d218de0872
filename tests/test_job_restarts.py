"""Restarts counted for the job, not per node: `ringtrain run --nnodes 2 --max-restarts N` across
two hosts (network namespaces joined by a veth pair, tests/netns.py).

    .venv/bin/pytest -q tests/test_job_restarts.py     # root and iproute2; skips otherwise

torch's agent counts the failures its own node saw (pytorch/pytorch#108158): after rank 1 on
host b fails, host b's workers are restarted with TORCHELASTIC_RESTART_COUNT=1 but host a's, which
did not fail, with 0; and each host spends its own --max-restarts. tests/scripts/restart_count.py
fails chosen ranks at chosen attempts and checks with an all-reduce that the ranks agree on
the count. Both tests are ~20 s: two launches, one or two restarts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from netns import Host, two_hosts_or_skip

from ringtrain.launch.network import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "restart_count.py"
ENV = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | {"PYTHONUNBUFFERED": "1"}
RUN_S = 150.0  # two launches, up to two restarts, on a busy 2-core machine


@pytest.fixture(scope="module")
def hosts():
    with two_hosts_or_skip("two-host tests") as pair:  # removed on exit, also after a failure
        yield pair


def _run_job(
    hosts: tuple[Host, Host], out: Path, max_restarts: int, plan: list[str]
) -> tuple[list, str]:
    """`ringtrain run` of the script on both hosts (one worker each); exit codes and output."""
    run_id, port = uuid.uuid4().hex[:8], free_port()
    procs = []
    for node_rank, host in enumerate(hosts):
        cmd = [sys.executable, "-m", "ringtrain", "run",
               "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id,
               "--rdzv-endpoint", f"{hosts[0].addr}:{port}", "--max-restarts", str(max_restarts),
               "--watchdog-timeout", "0", str(SCRIPT), str(out), *plan]
        log = open(out / f"node{node_rank}.log", "w")  # noqa: SIM115 (closed below)
        proc = host.popen(cmd, env=ENV, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    deadline = time.monotonic() + RUN_S
    try:
        for p, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p, _ in procs]
    finally:
        for h in hosts:
            h.kill_all()
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            log.close()
    return codes, "\n".join(f"--- node{i} ---\n{(out / f'node{i}.log').read_text()}"
                            for i in range(2))


def _attempts(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("attempt*-rank*"))


@pytest.mark.multinode
@pytest.mark.slow
def test_every_node_sees_the_jobs_restart_count(hosts, tmp_path):
    # Attempt 0: rank 1 (host b) fails; host a's rank 0 only waits, its agent restarts it
    # because host b rejoined. Both must see restart count 1 in attempt 1 (torch: a 0, b 1).
    codes, logs = _run_job(hosts, tmp_path, max_restarts=1, plan=["0:1"])
    assert codes == [0, 0], logs
    assert _attempts(tmp_path) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0",
                                   "attempt1-rank1"], logs


@pytest.mark.multinode
@pytest.mark.slow
def test_max_restarts_is_one_budget_for_the_job(hosts, tmp_path):
    # One restart allowed. Attempt 0: rank 1 (host b) fails, attempt 1: rank 0 (host a) fails.
    # The job has spent its restart: it ends (torch let host a restart once more on its own).
    codes, logs = _run_job(hosts, tmp_path, max_restarts=1, plan=["0:1", "1:0"])
    assert None not in codes and 0 not in codes, logs
    assert _attempts(tmp_path) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0",
                                   "attempt1-rank1"], logs
