"""Live recovery after a lost link: two network-namespace hosts, one host's link goes down.

    .venv/bin/pytest -q tests/test_live_link.py      (root and iproute2; skipped otherwise)

Host a runs the store (its own process: it must outlive the members) and two members, host b
the third (tests/scripts/live_member.py, world size 3). After all three commit step 3, host b's
link is taken down (`ip link set ... down`: its packets dropped, nothing refused, as a pulled
cable or a dead switch port), and the members on a go on into step 4's all-reduce. They find
b silent within about a second (its heartbeats no longer reach the store), form a generation
of two, redo step 4 and finish, in the processes they started in. Every step's loss is the
single-process full-batch reference's within 1e-4 (the data is the same, the sums' order not)
and every step's samples are its global batch, once. The namespaces are gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from netns import two_hosts, unavailable

from ringtrain.live import GlobalBatches

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "live_member.py"
sys.path.insert(0, str(SCRIPT.parent))
import live_member  # noqa: E402

PORT, PAUSE_AT = 29517, 3


def _reference_losses() -> list[float]:
    """One process, the whole global batch each step: the loss the members must report."""
    x, y = live_member.data()
    net = live_member.model()
    optimizer = live_member.Momentum(net.parameters())
    batches = GlobalBatches(live_member.N, live_member.BATCH, seed=1)
    losses = []
    for s in range(live_member.STEPS):
        ids = batches.batch(s)
        loss = (net(x[ids]) - y[ids]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g} s")
        time.sleep(0.02)


@pytest.mark.multinode
def test_members_on_the_other_host_go_on_when_a_hosts_link_goes_down(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(f"the link-loss test needs network namespaces: {reason}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    pause = tmp_path / "unplugged"
    with two_hosts() as (a, b):
        names = (a.netns, b.netns)
        store = a.popen([sys.executable, "-c", (
            "import time, torch.distributed as d; "
            f"s = d.TCPStore('{a.addr}', {PORT}, is_master=True, wait_for_workers=False); "
            "time.sleep(300)")], env=env)
        members = {}
        for host, pause_at in ((a, PAUSE_AT), (a, PAUSE_AT), (b, -1)):
            proc = host.popen([sys.executable, str(SCRIPT), a.addr, str(PORT), "3", str(tmp_path),
                               str(pause_at), str(pause)],
                              env={**env, "GLOO_SOCKET_IFNAME": host.ifname},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            members[proc.pid] = (host, proc)

        def records() -> list[dict]:
            out = []
            for path in tmp_path.glob("*.jsonl"):
                out += [{**json.loads(line), "file": path.stem}
                        for line in path.read_text().splitlines()]
            return out

        def at(step):
            return sum(r["step"] == step for r in records())

        def survivors_done():
            return len(list(tmp_path.glob("*.done"))) == 2

        try:
            _wait(lambda: at(PAUSE_AT) == 3, 90, "all three members committed step 3")
            b.unplug()
            pause.touch()
            _wait(survivors_done, 60, "the two members on host a finished")
        except AssertionError as e:
            outputs = []
            for host, proc in members.values():
                proc.kill()
                outputs.append(f"--- {host.netns}: {proc.communicate(timeout=10)[0][-3000:]}")
            raise AssertionError(f"{e}\n" + "\n".join(outputs)) from None
        finally:
            store.kill()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), f"namespaces left: {listed}"

    done = [json.loads(p.read_text()) for p in tmp_path.glob("*.done")]
    a_pids = {pid for pid, (host, _) in members.items() if host is a}
    assert {d["pid"] for d in done} == a_pids and all(d["pid_now"] == d["pid"] for d in done)
    reference = _reference_losses()
    steps: dict[int, list[dict]] = {}
    for r in records():
        steps.setdefault(r["step"], []).append(r)
    assert sorted(steps) == list(range(live_member.STEPS))
    batches = GlobalBatches(live_member.N, live_member.BATCH, seed=1)
    for s, rs in steps.items():
        assert [r["size"] for r in rs] == [3 if s <= PAUSE_AT else 2] * len(rs), f"step {s}"
        ids = Counter(i for r in rs for i in r["ids"])
        assert sorted(ids) == sorted(batches.batch(s)) and set(ids.values()) == {1}, f"step {s}"
        for r in rs:
            assert r["loss"] == pytest.approx(reference[s], abs=1e-4), f"step {s}"
