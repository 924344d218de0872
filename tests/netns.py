"""Two test "hosts" on one machine: network namespaces joined by a veth pair.

    with two_hosts() as (a, b):          # a.addr == "198.18.0.1", b.addr == "198.18.0.2"
        p = b.popen([python, "-c", "..."])
        b.kill_all()                     # SIGKILL every process inside host b
        # or b.unplug() first: its link goes down, packets dropped, no FIN/RST (power loss)

Addresses come from 198.18.0.0/15 (reserved for benchmarking); nothing leaves the machine.
The namespaces and links are removed on exit, also after a failure. `unavailable()` says why
namespaces cannot be made here (not root, no iproute2), for a clear skip reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def unavailable() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"rtprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    netns: str
    ifname: str
    addr: str

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` inside this host, in its own session (so it can be killed as a group)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], env=env,
                                start_new_session=True, **kw)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def unplug(self) -> None:
        """Take this host's link down: from now on its packets are dropped, none refused.

        Killing a host's processes makes its kernel close their sockets (FIN/RST), which peers
        notice at once; a host that loses power or network sends nothing. Unplug first, then
        `kill_all`, to have the second kind.
        """
        _ip("-n", self.netns, "link", "set", self.ifname, "down")

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link so far (the kernel's counter: headers included)."""
        out = subprocess.run(["ip", "netns", "exec", self.netns, "cat",
                              f"/sys/class/net/{self.ifname}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True, timeout=10)
        return int(out.stdout)

    def kill_all(self) -> None:
        """SIGKILL every process inside this host: the host 'vanishes'."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def reap(procs: list, hosts) -> None:
    """Nothing left of a test's launchers: every process inside `hosts` killed, `procs`
    (their `Popen`s, started with `Host.popen`) killed if still running and waited for."""
    for h in hosts:
        h.kill_all()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def can_delay() -> str | None:
    """None when tc's netem (link delay) works here, else the reason (then `two_hosts` relays
    frames through a third namespace instead, which needs ethtool)."""
    name = f"rtnetem{os.getpid()}"
    try:
        _ip("netns", "add", name)
        out = subprocess.run(["ip", "netns", "exec", name,
                              "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                             capture_output=True, text=True, timeout=10)
        return None if out.returncode == 0 else f"tc netem: {out.stderr.strip()} (no sch_netem)"
    finally:
        _ip("netns", "del", name, check=False)


def _limit(h: Host, rate: str | None, delay: str | None) -> None:
    """Each host shapes what it sends: `rate` with tbf, or rate and `delay` with netem."""
    if delay:
        spec = ["netem", "delay", delay, *(["rate", rate] if rate else []), "limit", "100000"]
    elif rate:
        spec = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    else:
        return
    subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.ifname, "root",
                    *spec], check=True, capture_output=True, timeout=10)


RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "delay_relay.py")


def _millis(delay: str) -> float:
    """"20ms" -> 20.0 (also "0.02s")."""
    return float(delay[:-2]) if delay.endswith("ms") else float(delay.rstrip("s")) * 1000


@contextmanager
def two_hosts(rate: str | None = None, delay: str | None = None):
    """Yield two hosts joined by a link; `rate` (e.g. "1gbit") adds a tc tbf limit, `delay`
    (e.g. "20ms", each way) a delay: netem's where the kernel has it (`can_delay`), else a
    relay process in a third namespace between two veth pairs (scripts/delay_relay.py)."""
    tag = f"rt{os.getpid() % 100000}"
    hosts = [Host(f"{tag}a", f"{tag}va", "198.18.0.1"), Host(f"{tag}b", f"{tag}vb", "198.18.0.2")]
    relay_ns = f"{tag}r" if delay and can_delay() else None
    relay = None
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
        if relay_ns is None:
            _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        else:
            _ip("netns", "add", relay_ns)
            middle = [f"{tag}ra", f"{tag}rb"]
            for h, m in zip(hosts, middle, strict=True):
                _ip("link", "add", h.ifname, "type", "veth", "peer", "name", m)
                _ip("link", "set", m, "netns", relay_ns)
                # Jumbo frames end to end: the relay's raw sockets pass frames whole.
                _ip("-n", relay_ns, "link", "set", m, "mtu", "65535", "promisc", "on", "up")
                _ip("link", "set", h.ifname, "mtu", "65535")
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _limit(h, rate, delay if relay_ns is None else None)
            if relay_ns is not None:
                # The relay passes frames as they are: their TCP checksums must be in them
                # already, not left to a NIC that a veth only pretends to be.
                subprocess.run(["ip", "netns", "exec", h.netns, "ethtool", "-K", h.ifname, "tx",
                                "off"], check=True, capture_output=True, timeout=10)
        if relay_ns is not None:  # once both links are up
            relay = subprocess.Popen(["ip", "netns", "exec", relay_ns, sys.executable, RELAY,
                                      *middle, str(_millis(delay))], start_new_session=True)
        yield hosts
    finally:
        for h in hosts:
            h.kill_all()
            _ip("netns", "del", h.netns, check=False)  # deleting a namespace removes its veth end
        if relay is not None:
            relay.terminate()
            relay.wait(timeout=10)
        if relay_ns is not None:
            _ip("netns", "del", relay_ns, check=False)


def two_hosts_or_skip(what: str):
    """`two_hosts()` for a pytest fixture to yield from; the test skips, saying why, where this
    machine cannot make network namespaces. `what` names the tests in the message."""
    import pytest

    reason = unavailable()
    if reason:
        pytest.skip(f"{what} need network namespaces: {reason}")
    return two_hosts()
