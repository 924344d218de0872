"""How workers and servers talk: the rank layout, the process groups and the messages.

Layout: of `world_size` ranks, the first W = world_size - S are workers (rank 0 is a worker, as
in any data-parallel script) and the last S are servers. Every (server, worker) pair has its own
two-rank gloo group, so a server can serve each worker from its own thread (gloo is not safe
for concurrent point-to-point on one group) and a dead worker breaks only its own pair.

Messages on a pair group, in order:

    worker -> server   pull()                         at set-up and after a restore
    server -> worker   params(version, gap)           the answer: the current parameters
    worker -> server   push(clock, base, lr, clip)    as the step's last backward starts,
                       bucket(b) ...                  each as soon as its gradients are ready,
                       norm(|g|^2)                    when backward is done
    server -> worker   params(version, gap)           the answer: parameters after the update
    worker -> server   sync()                         entering an end-of-run collective
    worker -> server   done()                         when the worker leaves

A message is a small float64 header and, where it has one, a flat fp32 payload (a push's
payload is cut into buckets of whole parameters, see `sharding.bucket_bounds`). Every call
below is one message part; nothing is dispatched on strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from ringtrain import staging

HEADER_TAG = 1  # each part of a message has its own tag, so parts cannot be mistaken
PARAMS_TAG = 2  # server -> worker: the parameters
NORM_TAG = 3  # worker -> server: the squared norm of the whole gradient, after the buckets
BUCKET_TAG = 16  # worker -> server: gradient bucket b travels with tag BUCKET_TAG + b
HEADER_LEN = 7


class Kind(IntEnum):
    """What a header announces."""

    PUSH = 1  # worker -> server: gradients follow; answered with parameters
    PULL = 2  # worker -> server: answered with the current parameters, nothing applied
    SYNC = 3  # worker -> server: this worker waits at an end-of-run sync point (no answer)
    DONE = 4  # worker -> server: no more messages
    PARAMS = 5  # server -> worker: parameters follow
    ABORT = 6  # server -> worker: parameters follow, but the job failed (sync lost a worker)


class PSError(RuntimeError):
    """The parameter-server job cannot go on (e.g. sync mode lost a worker)."""


@dataclass(frozen=True)
class PSTopology:
    """Who is a worker and who is a server among `world_size` ranks.

    Args:
        world_size: all ranks of the job.
        servers: how many of them (the last ones) are servers.
    """

    world_size: int
    servers: int

    def __post_init__(self) -> None:
        if not isinstance(self.servers, int) or self.servers < 1:
            raise ValueError(f"servers={self.servers!r}: use at least 1 server (--servers 1)")
        if self.world_size - self.servers < 1:
            raise ValueError(
                f"--servers {self.servers} leaves no worker among world_size={self.world_size} "
                f"ranks; launch at least {self.servers + 1} processes (--nproc-per-node "
                f"{self.servers + 1}) or lower --servers")

    @property
    def workers(self) -> int:
        return self.world_size - self.servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.workers))

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.workers, self.world_size))

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def server_index(self, rank: int) -> int:
        return rank - self.workers

    def tolerated_ranks(self, mode: str) -> frozenset[int]:
        """Ranks whose death the job survives in `mode`: async/ssp workers other than rank 0.

        Rank 0 reports (summary, metrics) and the servers hold the only copy of the parameters;
        a sync step needs every worker's gradient.
        """
        return frozenset() if mode == "sync" else frozenset(self.worker_ranks[1:])


@dataclass(frozen=True)
class PSGroups:
    """The process groups a parameter-server job uses, built by `make_ps_groups`."""

    pairs: dict[tuple[int, int], dist.ProcessGroup]  # (server rank, worker rank) -> its group
    servers: dist.ProcessGroup | None  # the servers only (sync clipping); None with one server
    everyone: dist.ProcessGroup  # all ranks: end-of-run state gathering, kept off the trainer's


def make_ps_groups(topology: PSTopology, timeout_s: float) -> PSGroups:
    """Create every group; all ranks must call this, in the same order (as `dist.new_group`).

    `timeout_s` bounds every wait on a pair: a worker that neither answers nor closes its
    connection is declared lost after it.
    """
    timeout = timedelta(seconds=timeout_s)
    pairs = {}
    for s in topology.server_ranks:
        for w in topology.worker_ranks:
            pairs[(s, w)] = dist.new_group([s, w], timeout=timeout, backend="gloo")
    servers = None
    if topology.servers > 1:
        servers = dist.new_group(topology.server_ranks, timeout=timeout, backend="gloo")
    everyone = dist.new_group(list(range(topology.world_size)), timeout=timeout, backend="gloo")
    return PSGroups(pairs, servers, everyone)


@dataclass(frozen=True)
class Header:
    """A decoded header. Fields a message kind does not use are 0."""

    kind: Kind
    clock: int  # push: the worker's step count including this push; params: the worker's clock
    version: int  # push: version of the parameters the gradient came from; params: version sent
    lr: float  # push: learning rate for this update
    grad_clip: float  # push: max global norm (sync mode clips on the servers); 0 = none
    gap: int  # params: how far this worker is ahead of the slowest (SSP's staleness) at release
    applied: int  # params: gradients applied so far, from every worker (samples / batch size)


def _header(kind: Kind, clock: int = 0, version: int = 0, lr: float = 0.0,
            grad_clip: float = 0.0, gap: int = 0, applied: int = 0) -> torch.Tensor:
    return torch.tensor([kind, clock, version, lr, grad_clip, gap, applied], dtype=torch.float64)


def _decode(t: torch.Tensor) -> Header:
    kind, clock, version, lr, grad_clip, gap, applied = t.tolist()
    return Header(Kind(int(kind)), int(clock), int(version), lr, grad_clip, int(gap), int(applied))


# -- worker side ------------------------------------------------------------------------------
def send_push_header(*, clock: int, base_version: int, lr: float, grad_clip: float | None,
                     server: int, group: dist.ProcessGroup) -> dist.Work:
    """Open a push: its buckets and its norm follow (`send_bucket`, `send_push_norm`)."""
    head = _header(Kind.PUSH, clock, base_version, lr, grad_clip or 0.0)
    return dist.isend(head, server, group=group, tag=HEADER_TAG)


def send_bucket(grads: torch.Tensor, *, bucket: int, server: int,
                group: dist.ProcessGroup) -> staging.StagedWork:
    """Start sending gradient bucket `bucket` of a push (a contiguous slice of the flat buffer)."""
    return staging.isend(grads, group, dst=server, tag=BUCKET_TAG + bucket)


def send_push_norm(sq_norm: float, *, server: int, group: dist.ProcessGroup) -> dist.Work:
    """Close a push with the squared norm of the worker's whole gradient (async clipping)."""
    t = torch.tensor([sq_norm], dtype=torch.float64)
    return dist.isend(t, server, group=group, tag=NORM_TAG)


def send_pull(*, server: int, group: dist.ProcessGroup) -> dist.Work:
    """Ask for the current parameters (post the receive first: `post_recv_params`)."""
    return dist.isend(_header(Kind.PULL), server, group=group, tag=HEADER_TAG)


def send_sync(*, server: int, group: dist.ProcessGroup) -> None:
    """Tell the server this worker is entering an end-of-run collective (see `serve`)."""
    dist.send(_header(Kind.SYNC), server, group=group, tag=HEADER_TAG)


def send_done(*, server: int, group: dist.ProcessGroup) -> None:
    """Tell the server this worker sends nothing more; its thread ends."""
    dist.send(_header(Kind.DONE), server, group=group, tag=HEADER_TAG)


class PendingParams:
    """A pull in flight: receive buffers posted before the push, so the reply lands at once."""

    def __init__(self, out: torch.Tensor, server: int, group: dist.ProcessGroup):
        self._head = torch.zeros(HEADER_LEN, dtype=torch.float64)
        self._works = [dist.irecv(self._head, server, group=group, tag=HEADER_TAG),
                       staging.irecv(out, group, src=server, tag=PARAMS_TAG)]

    def wait(self) -> Header:
        for w in self._works:
            w.wait()
        return _decode(self._head)


def post_recv_params(out: torch.Tensor, *, server: int, group: dist.ProcessGroup) -> PendingParams:
    """Post the receives for `server`'s next parameter message into `out`."""
    return PendingParams(out, server, group)


# -- server side ------------------------------------------------------------------------------
def recv_request(grads_out: torch.Tensor, buckets: list[tuple[int, int]], *, worker: int,
                 group: dist.ProcessGroup) -> tuple[Header, float]:
    """Block until `worker`'s next message: (header, squared gradient norm; 0 unless a push).

    A push's buckets land in their slices of `grads_out`, in whatever order they were sent.
    Raises RuntimeError (gloo's) when the worker's connection closes or the pair times out.
    """
    head = torch.zeros(HEADER_LEN, dtype=torch.float64)
    dist.recv(head, worker, group=group, tag=HEADER_TAG)
    header = _decode(head)
    if header.kind != Kind.PUSH:
        return header, 0.0
    sq_norm = torch.zeros(1, dtype=torch.float64)
    works = [staging.irecv(grads_out[a:b], group, src=worker, tag=BUCKET_TAG + i)
             for i, (a, b) in enumerate(buckets)]
    works.append(dist.irecv(sq_norm, worker, group=group, tag=NORM_TAG))
    for w in works:
        w.wait()
    return header, float(sq_norm)


def send_params(params: torch.Tensor, *, kind: Kind, version: int, clock: int, gap: int,
                applied: int, worker: int, group: dist.ProcessGroup) -> None:
    """Send the shard's parameters (a pull's answer) with its version; blocks until sent."""
    head = _header(kind, clock, version, gap=gap, applied=applied)
    works = [dist.isend(head, worker, group=group, tag=HEADER_TAG),
             staging.isend(params, group, dst=worker, tag=PARAMS_TAG)]
    for w in works:
        w.wait()
