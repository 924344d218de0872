"""Rendezvous for `ringtrain run`: a free port on one node, reachable addresses across nodes.

    ringtrain run --nproc-per-node 2 train.py                                     # one node
    ringtrain run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 train.py   # on each node

What the launcher (`ringtrain.launch.launcher._run`) does to torchrun's arguments and to torch's
rendezvous before `elastic_launch` starts:
- on a single node, a c10d rendezvous at localhost:0, so the OS picks a free port and two jobs
  at once never collide (`_single_node_rendezvous`);
- across nodes, this node's address on the route to the rendezvous host, not the one its
  hostname resolves to (`_multi_node_addresses`);
- across nodes, a rendezvous handler whose store queries cannot block the agent when the store's
  host vanishes (`_BoundedRendezvous`, installed by `_bounded_rendezvous`);
- a port the user named that another process holds, said with its fixes (`port_in_use`).

.. warning:: relies on torch internals (the launcher's rendezvous registry, torch's own test
   of whether a host names this machine), taken through `ringtrain.torch_internals`, which
   checks them at import.
"""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator

import torch
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ringtrain.launch.network import network_interfaces, route_source
from ringtrain.torch_internals import RDZV_REGISTRY, matches_machine_hostname

# Across nodes, the agent gives up on a rendezvous store silent this long (the watchdog's
# default timeout: the workers notice the same loss about as fast), and waits this long
# to close the rendezvous on its way out.
RENDEZVOUS_SILENT_S, RENDEZVOUS_CLOSE_S = 30.0, 3.0


def _single_node_rendezvous(args) -> None:
    """What `--standalone` does, also for a plain `--nnodes 1` without an endpoint.

    c10d rendezvous at localhost:0: the agent's TCPStore binds port 0 and the OS hands it a
    free port, so there is no window in which another job can take it.
    """
    try:
        max_nodes = int(str(args.nnodes).split(":")[-1])
    except ValueError:
        raise ValueError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX, "
                         "e.g. --nnodes 2") from None
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) < 1:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node}: "
                         "start at least one worker per node")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: it must be 0 or more (restarts "
                         "of the whole job after a worker fails)")
    if not args.monitor_interval > 0:  # torch's agent asserts it, with no words
        raise ValueError(f"--monitor-interval {args.monitor_interval:g}: it must be above 0 "
                         "(seconds between the agent's looks at its workers; 0.1 by default)")
    word = str(args.nproc_per_node)
    # torch's words for a count: auto, cpu, gpu, or a device module's name (xpu, a plug-in's)
    device = getattr(torch, word, None) if word.isidentifier() else None
    if not word.isdigit() and word not in ("auto", "cpu", "gpu") and not (
            isinstance(device, types.ModuleType) and hasattr(device, "is_available")):
        raise ValueError(f"--nproc-per-node {args.nproc_per_node}: give a number of workers per "
                         "node, or auto (one per GPU, else one per CPU core), gpu or cpu")
    if args.node_rank >= max_nodes:  # it would wait for a rendezvous that never completes
        raise ValueError(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: "
                         f"number the nodes 0..{max_nodes - 1}, node 0 at --rdzv-endpoint")
    if max_nodes > 1 and args.rdzv_endpoint and not args.rdzv_endpoint.rpartition(":")[2].isdigit():
        raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint}: give node 0's address and a free "
                         "port as HOST:PORT, e.g. 10.0.0.1:29400")
    if args.standalone or (max_nodes == 1 and not args.rdzv_endpoint and args.master_port is None
                           and args.rdzv_backend in ("static", "c10d")):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d", "localhost:0", str(uuid.uuid4()))

    if args.master_port is None:
        args.master_port = 29500  # only read by the static backend, as in torchrun


def backend_missing(error: BaseException, args) -> str | None:
    """The words for a --rdzv-backend torch cannot use (not registered; etcd's client not
    installed), or None for any other error."""
    text, name = str(error), args.rdzv_backend
    if "is not registered" in text:
        return (f"--rdzv-backend {name}: not a rendezvous backend torch knows; use c10d (the "
                "store on node 0, nothing to install) or static")
    if type(error).__name__ == "EtcdStubError" or "'etcd' module is required" in text:
        return (f"--rdzv-backend {name} needs an etcd server and its Python client (pip install "
                "python-etcd); c10d needs neither: the store runs on node 0")
    return None


def port_in_use(error: BaseException, args) -> str | None:
    """The words for a rendezvous port that another process holds (torch's agent: "The server
    socket has failed to listen ... EADDRINUSE"), or None for any other error. Only a port
    the user named: on one node without one, the OS picks a free port."""
    text = str(error)
    if "EADDRINUSE" not in text and "ddress already in use" not in text:
        return None
    found = re.search(r"port: (\d+)", text)
    port = found.group(1) if found else str(args.master_port)
    named = (f"--rdzv-endpoint {args.rdzv_endpoint}" if args.rdzv_backend == "c10d"
             else f"--master-port {args.master_port}")
    one_node = str(args.nnodes).split(":")[-1] == "1"
    return (f"port {port} ({named}) is in use on this host by another process (another job's "
            f"store? `ss -ltnp 'sport = :{port}'` names it); "
            + ("leave it out: on one node ringtrain run picks a free port" if one_node else
               "give node 0 a free port, the same on every node"))


def _multi_node_addresses(args) -> None:
    """Across nodes: advertise the address that reaches the rendezvous host, not the hostname's.

    torch's agent advertises `socket.getfqdn()` as MASTER_ADDR and decides whether it hosts the
    c10d store by resolving its hostname; where the hostname resolves to 127.0.0.1 (common on
    cloud images and containers) the other nodes get an unreachable MASTER_ADDR and node 0 does
    not host the store it was named for. So when --nnodes > 1: `--local-addr` defaults to this
    node's IPv4 address on the interface that routes to the --rdzv-endpoint host, and the node
    whose own address is the endpoint hosts the c10d store (`is_host`, unless --rdzv-conf says).
    """
    max_nodes = int(str(args.nnodes).split(":")[-1])
    if max_nodes == 1 or not args.rdzv_endpoint:
        return
    host = args.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        return  # unresolvable: torch's rendezvous says so with the endpoint in the message
    local = route_source(host_ip)
    if local is None:
        return
    interfaces = network_interfaces()
    if args.local_addr is None:
        args.local_addr = local
        names = [n for n, a in interfaces.items() if a == local]
        print(f"ringtrain run: node {args.node_rank}: local address {local} (interface "
              f"{names[0] if names else '?'}), the route to the rendezvous endpoint "
              f"{args.rdzv_endpoint}; --local-addr overrides it", file=sys.stderr, flush=True)
    conf = args.rdzv_conf or ""
    if (args.rdzv_backend == "c10d" and "is_host=" not in conf
            and host_ip in interfaces.values() and not matches_machine_hostname(host)):
        args.rdzv_conf = ",".join(filter(None, [conf, "is_host=true"]))


def _call_into(fn: Callable, out: list) -> None:
    try:
        out.append((fn(), None))
    except Exception as e:  # handed to the caller's thread
        out.append((None, e))


class _BoundedRendezvous:
    """torch's rendezvous handler, but the agent never blocks on a vanished store host.

    While its workers run, torch's agent asks the rendezvous store every monitor interval
    whether nodes wait to join (`num_nodes_waiting`), and it closes the rendezvous on its way
    out (`shutdown`). When the store's host vanishes without closing its sockets (power or
    network loss), each such call blocks for minutes (the TCPStore client waits, then retries),
    so the launcher would hang long after its workers' watchdogs stopped them. Here the query
    runs on a helper thread: while one is pending the agent gets the last answer and goes on
    watching its workers; one pending for `silent_s` raises; `shutdown` gives up after `close_s`.

    `live` (`ringtrain train --live`): the answer is 0, and a failed query is not raised.
    torch's agent restarts every worker of every node when a node waits to join
    (`_invoke_run`), which would undo a live job's point: the members replace what they lose,
    and a node that arrives late waits outside until the job ends. A lost store host is the
    live agent's to find and say (`ringtrain.launch.live_store`, 10 s), with its workers
    stopped at once, not torch's SIGTERM and shutdown timeout; only a query hung for
    `silent_s` still raises, as a last bound.
    """

    def __init__(self, inner, endpoint: str, silent_s: float, close_s: float,
                 live: bool = False):
        self._inner, self._endpoint = inner, endpoint
        self._silent_s, self._close_s, self._live = silent_s, close_s, live
        self._waiting = 0
        self._pending: tuple[threading.Thread, float, list] | None = None

    def num_nodes_waiting(self) -> int:
        if self._pending is None:
            out: list = []
            thread = threading.Thread(target=_call_into, args=(self._inner.num_nodes_waiting, out),
                                      name="ringtrain-rdzv-query", daemon=True)
            thread.start()
            self._pending = (thread, time.monotonic(), out)
        thread, started, out = self._pending
        thread.join(timeout=1.0)  # a live store answers in milliseconds
        if thread.is_alive():
            if time.monotonic() - started > self._silent_s:
                raise RendezvousConnectionError(
                    f"the rendezvous store at {self._endpoint} did not answer for "
                    f"{self._silent_s:g} s")
            return self._waiting
        self._pending = None
        value, error = out[0]
        if error is not None and not self._live:  # live: the agent's own watch says it
            raise error
        self._waiting = value
        return 0 if self._live else value

    def shutdown(self) -> bool:
        out: list = []
        thread = threading.Thread(target=_call_into, args=(self._inner.shutdown, out), daemon=True)
        thread.start()
        thread.join(timeout=self._close_s)
        return bool(out and out[0][0])

    def __getattr__(self, name: str):  # the rest as torch's (joins: torch bounds them)
        return getattr(self._inner, name)


@contextlib.contextmanager
def _bounded_rendezvous(endpoint: str, live: bool = False) -> Iterator[None]:
    """Have `elastic_launch` (only it) wrap its rendezvous handler in `_BoundedRendezvous`
    (`live`: no node is ever let in after the start)."""
    registry = RDZV_REGISTRY.get()
    with RDZV_REGISTRY.replaced(types.SimpleNamespace(
            get_rendezvous_handler=lambda params: _BoundedRendezvous(
                registry.get_rendezvous_handler(params), endpoint, RENDEZVOUS_SILENT_S,
                RENDEZVOUS_CLOSE_S, live=live))):
        yield
