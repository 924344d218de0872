"""A link with a delay, for kernels without netem: relay Ethernet frames between two interfaces.

    ip netns exec R python delay_relay.py ra rb 20     # every frame waits 20 ms, both ways

Run inside a namespace holding the middle ends of two veth pairs (no addresses there): each
frame that arrives on one interface leaves on the other `delay_ms` later, in order. The hosts
at the outer ends see one L2 link with that one-way delay; their own `tc` shapes the rate.
Use a large MTU on every veth (65535): the relay's raw sockets cannot split TCP's large frames.
Stops on SIGTERM.
"""

from __future__ import annotations

import heapq
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def main(a: str, b: str, delay_ms: float) -> None:
    socks = {}
    for name in (a, b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, 0))
        s.setblocking(False)
        socks[name] = s
    other = {socks[a]: socks[b], socks[b]: socks[a]}
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    seq, delay = 0, delay_ms / 1000
    running = True

    def stop(*_):
        nonlocal running
        running = False
    signal.signal(signal.SIGTERM, stop)
    while running:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
            except OSError:
                pass  # a frame too large or the link down: dropped, as a wire would
        timeout = max(0.0, queue[0][0] - now) if queue else 0.5
        ready, _, _ = select.select(list(other), [], [], timeout)
        for s in ready:
            while True:
                try:
                    frame, addr = s.recvfrom(70000)
                except BlockingIOError:
                    break
                except OSError:  # the link went down (a host unplugged): nothing to relay
                    break
                if addr[2] == PACKET_OUTGOING:  # our own sends, seen again
                    continue
                seq += 1
                heapq.heappush(queue, (time.monotonic() + delay, seq, other[s], frame))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
