"""One worker rank's side of the parameter server: push gradients, pull parameters.

Used by `PSStrategy` on worker ranks; tests drive it directly (`.venv/bin/pytest -q
tests/test_ps.py`).

A step's communication is one push per server and one answer back. The receive for every
server's answer is posted before the step's last backward starts; each push is cut into
buckets of whole parameters, and a gradient hook sends a bucket the moment its gradients are
final, so pushing overlaps the rest of backward; the pushes to all servers are in flight
together, so the servers work on their shards at the same time and each answer lands as soon
as its server is done. Buffers are flat, on the CPU (the transport is gloo), allocated once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ps.protocol import (
    Kind,
    PSError,
    post_recv_params,
    send_bucket,
    send_done,
    send_pull,
    send_push_header,
    send_push_norm,
    send_sync,
)
from ringtrain.ps.sharding import (
    DEFAULT_BUCKET_NUMEL,
    Piece,
    ShardPlan,
    bucket_bounds,
    pack,
    unpack,
)
from ringtrain.ps.stats import Tally
from ringtrain.trace import COMM, NO_TRACE, Tracer


@dataclass
class PullResult:
    """What one exchange with every server brought back."""

    comm_s: float  # time from the first send to the last answer
    gap: int  # steps ahead of the slowest worker when answered (max over servers)


class PSWorker:
    """Keep `module`'s parameters in step with the servers.

    Args:
        module: the worker's full model replica (parameters are overwritten by pulls).
        plan: which server holds which piece (`plan_shards` over `module`'s parameters).
        rank: this worker's global rank.
        server_ranks: global rank of server index 0, 1, ...
        pair_groups: server rank -> the group this worker shares with it.
        bucket_numel: push bucket size in elements (the servers must use the same).
        tracer: records each push-and-pull exchange (`ringtrain.trace`; default: nothing).
    """

    def __init__(self, module: nn.Module, plan: ShardPlan, *, rank: int,
                 server_ranks: Sequence[int], pair_groups: Mapping[int, dist.ProcessGroup],
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, tracer: Tracer = NO_TRACE):
        self.module, self.plan, self.rank, self.tracer = module, plan, rank, tracer
        self.server_ranks = list(server_ranks)
        self.pair_groups = dict(pair_groups)
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        missing = [n for n, _ in plan.shapes if n not in self.params]
        if missing or len(self.params) != len(plan.shapes):
            raise ValueError(f"rank {rank}: the shard plan names {missing or 'fewer'} parameters "
                             f"than the model's trainable ones {list(self.params)[:5]}...; build "
                             "the plan from this model's named_parameters()")
        self._pieces = [plan.for_server(i) for i in range(plan.servers)]
        self._grads = [torch.zeros(plan.server_numel(i)) for i in range(plan.servers)]
        self._flats = [torch.zeros(plan.server_numel(i)) for i in range(plan.servers)]
        self.versions = [0] * plan.servers  # the version of each shard this replica holds
        self.applied = 0  # gradients (all workers') the replica's parameters hold
        self.clock = 0  # pushes sent
        self.pushed_at = 0.0  # time.monotonic() just before the last push left (instrument)
        self.gap = Tally()
        self._left = False
        self._server: int | None = None  # the server being talked to, for error messages
        # Buckets: per server, [start, end) slices of its flat buffer, made of whole pieces.
        self._buckets = [bucket_bounds(pieces, bucket_numel) for pieces in self._pieces]
        self._bucket_pieces: dict[tuple[int, int], list[Piece]] = {}
        self._slots: dict[str, list[tuple[int, int]]] = {n: [] for n in self.params}
        for i, pieces in enumerate(self._pieces):
            for p in pieces:
                b = next(b for b, (a, z) in enumerate(self._buckets[i]) if a <= p.offset < z)
                self._bucket_pieces.setdefault((i, b), []).append(p)
                self._slots[p.name].append((i, b))
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, n=n: self._on_grad(n))
                       for n, p in self.params.items()]

    # -- exchanges ---------------------------------------------------------------------------
    def pull(self) -> PullResult:
        """Fetch the current parameters from every server (set-up, after a restore)."""
        t0 = time.perf_counter()
        with self._naming_lost_server():
            pending = self._post_receives()
            sends = []
            for s in self.server_ranks:
                self._server = s
                sends.append((s, send_pull(server=s, group=self.pair_groups[s])))
        return self._finish(pending, sends, t0, record=False)

    def _post_receives(self) -> list:
        """Post each server's answer receive; a server already gone is named (`_server`)."""
        pending = []
        for i, s in enumerate(self.server_ranks):
            self._server = s
            pending.append(post_recv_params(self._flats[i], server=s, group=self.pair_groups[s]))
        return pending

    def push_pull(self, *, lr: float, grad_clip: float | None = None) -> PullResult:
        """Send this step's gradients (`.grad` of the module) and take the updated parameters.

        The naive reference: everything is sent after backward. `begin_push()` before the
        last backward, then `finish_push()`, sends the same messages, earlier.
        """
        self.begin_push(lr=lr, grad_clip=grad_clip, overlap=False)
        return self.finish_push()

    def begin_push(self, *, lr: float, grad_clip: float | None = None,
                   overlap: bool = True) -> None:
        """Open this step's push; call just before the step's last backward.

        Answers' receives are posted and every server is told a push is coming. With
        `overlap`, each gradient bucket is sent from a gradient hook the moment its last
        parameter's gradient is final, while backward goes on with earlier layers (buckets
        fill in reverse layer order, as gradients are produced). `grad_clip` travels with
        the push: the servers clip the mean gradient (sync) or each push by its own norm.
        """
        self._t0 = time.perf_counter()
        self.clock += 1
        self._sends = []
        with self._naming_lost_server():
            self._pending = self._post_receives()
            self.pushed_at = time.monotonic()
            for i, s in enumerate(self.server_ranks):
                self._server = s
                self._sends.append((s, send_push_header(
                    clock=self.clock, base_version=self.versions[i], lr=lr, grad_clip=grad_clip,
                    server=s, group=self.pair_groups[s])))
        self._unsent = {(i, b) for i, bs in enumerate(self._buckets) for b in range(len(bs))}
        self._missing = {key: len(pieces) for key, pieces in self._bucket_pieces.items()}
        self._armed = overlap

    def _on_grad(self, name: str) -> None:
        """Gradient hook: `name`'s gradient is final for this backward."""
        if not self._armed:
            return
        for key in self._slots[name]:
            self._missing[key] -= 1
            if self._missing[key] == 0:
                self._send_bucket(*key)

    def _send_bucket(self, i: int, b: int) -> None:
        s = self.server_ranks[i]
        a, z = self._buckets[i][b]
        grads = {n: self.params[n].grad for n in {p.name for p in self._bucket_pieces[(i, b)]}}
        pack(grads, self._bucket_pieces[(i, b)], self._grads[i])
        with self._naming_lost_server():
            self._server = s
            self._sends.append((s, send_bucket(self._grads[i][a:z], bucket=b, server=s,
                                               group=self.pair_groups[s])))
        self._unsent.discard((i, b))

    def finish_push(self) -> PullResult:
        """Send what backward did not (all, without overlap), then wait for the answers."""
        self._armed = False
        for key in sorted(self._unsent):  # parameters that got no gradient count as zeros
            self._send_bucket(*key)
        sq_norm = sum(float(p.grad.double().pow(2).sum()) for p in self.params.values()
                      if p.grad is not None)
        with self._naming_lost_server():
            for s in self.server_ranks:
                self._server = s
                self._sends.append((s, send_push_norm(sq_norm, server=s,
                                                      group=self.pair_groups[s])))
        return self._finish(self._pending, self._sends, self._t0, record=True)

    @contextmanager
    def _naming_lost_server(self):
        """Turn gloo's "connection closed" into a PSError that names the server rank."""
        self._server = None
        try:
            yield
        except RuntimeError as e:
            where = f"server rank {self._server}" if self._server is not None else "a server"
            raise PSError(
                f"worker rank {self.rank}: lost {where} at step {self.clock} "
                f"({str(e).splitlines()[0][:160]}); the servers hold the only copy of the "
                "optimizer state: restart from the last snapshot") from e

    def _finish(self, pending, sends, t0: float, *, record: bool) -> PullResult:
        with self._naming_lost_server(), self.tracer.span("wait for servers"):
            for s, w in sends:
                self._server = s
                w.wait()
            heads = []
            for i, p in enumerate(pending):
                self._server = self.server_ranks[i]
                heads.append(p.wait())
        gap, aborted = 0, []
        for i, head in enumerate(heads):
            self.versions[i] = head.version
            self.applied = head.applied if i == 0 else min(self.applied, head.applied)
            gap = max(gap, head.gap)
            if head.kind == Kind.ABORT:
                aborted.append(self.server_ranks[i])
        if aborted:
            raise PSError(f"worker rank {self.rank}: servers {aborted} aborted the job at step "
                          f"{self.clock} (see the servers' error: a sync-mode worker was lost)")
        with torch.no_grad():
            for i in range(self.plan.servers):
                unpack(self._flats[i], self._pieces[i], self.params)
        if record:
            self.gap.add(gap)
        if self.tracer.active:  # from the push header to the last parameters unpacked
            self.tracer.add("push and pull", COMM, round(t0 * 1e9), time.perf_counter_ns(),
                            {"gap": gap})
        return PullResult(time.perf_counter() - t0, gap)

    def sync_point(self) -> None:
        """Tell every server this worker is entering an end-of-run collective."""
        with self._naming_lost_server():
            for s in self.server_ranks:
                self._server = s
                send_sync(server=s, group=self.pair_groups[s])

    def leave(self) -> None:
        """Tell every server this worker is done (idempotent); removes the gradient hooks."""
        if self._left:
            return
        self._left = True
        for h in self._hooks:
            h.remove()
        for s in self.server_ranks:
            send_done(server=s, group=self.pair_groups[s])
