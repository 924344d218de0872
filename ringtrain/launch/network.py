"""This machine's side of the network, as the launcher sees it: its interfaces, the address it
routes from towards a host, and a free port. Only `ringtrain.launch` and the test helpers
(`ringtrain.testing`, tests/, benchmarks/) use them.

    python -c "from ringtrain.launch.network import network_interfaces as n; print(n())"
"""

from __future__ import annotations

import fcntl
import socket
import struct


def network_interfaces() -> dict[str, str]:
    """IPv4 address of every local interface that has one: {name: address}."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address (Linux)
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_source(host_ip: str) -> str | None:
    """This machine's IPv4 address on the route to `host_ip`, or None when there is no route.

    A UDP connect sends nothing; it only asks the kernel which source address the route uses.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host_ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it).

    .. warning:: another process may take it before you bind it; tests that race for ports
       retry or use a `file://` rendezvous.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
