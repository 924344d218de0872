"""One worker rank's side of the parameter server: push gradients, pull parameters.

Used by `PSStrategy` on worker ranks; tests drive it directly (`.venv/bin/pytest -q
tests/test_ps.py`).

A step's communication is one message per server each way. The receive for every server's
answer is posted before any gradient is sent, and the pushes to all servers are in flight
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
    send_done,
    send_pull,
    send_push,
    send_sync,
)
from ringtrain.ps.sharding import ShardPlan, pack, unpack
from ringtrain.ps.stats import Tally


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
    """

    def __init__(self, module: nn.Module, plan: ShardPlan, *, rank: int,
                 server_ranks: Sequence[int], pair_groups: Mapping[int, dist.ProcessGroup]):
        self.module, self.plan, self.rank = module, plan, rank
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

    # -- exchanges ---------------------------------------------------------------------------
    def pull(self) -> PullResult:
        """Fetch the current parameters from every server (set-up, after a restore)."""
        t0 = time.perf_counter()
        with self._naming_lost_server():
            pending = [post_recv_params(self._flats[i], server=s, group=self.pair_groups[s])
                       for i, s in enumerate(self.server_ranks)]
            sends = [(s, send_pull(server=s, group=self.pair_groups[s])) for s in self.server_ranks]
        return self._finish(pending, sends, t0, record=False)

    def push_pull(self, *, lr: float, grad_clip: float | None = None) -> PullResult:
        """Send this step's gradients (`.grad` of the module) and take the updated parameters.

        `grad_clip` travels with the push: the servers apply it to the averaged gradient in
        sync mode; in async/ssp the caller clips before pushing and passes None.
        """
        t0 = time.perf_counter()
        grads = {n: p.grad for n, p in self.params.items()}
        self.clock += 1
        sends = []
        with self._naming_lost_server():
            pending = [post_recv_params(self._flats[i], server=s, group=self.pair_groups[s])
                       for i, s in enumerate(self.server_ranks)]
            self.pushed_at = time.monotonic()
            for i, s in enumerate(self.server_ranks):
                self._server = s
                pack(grads, self._pieces[i], self._grads[i])
                sends += [(s, w) for w in send_push(
                    self._grads[i], clock=self.clock, base_version=self.versions[i], lr=lr,
                    grad_clip=grad_clip, server=s, group=self.pair_groups[s])]
        return self._finish(pending, sends, t0, record=True)

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
        with self._naming_lost_server():
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
        return PullResult(time.perf_counter() - t0, gap)

    def sync_point(self) -> None:
        """Tell every server this worker is entering an end-of-run collective."""
        with self._naming_lost_server():
            for s in self.server_ranks:
                self._server = s
                send_sync(server=s, group=self.pair_groups[s])

    def leave(self) -> None:
        """Tell every server this worker is done (idempotent)."""
        if self._left:
            return
        self._left = True
        for s in self.server_ranks:
            send_done(server=s, group=self.pair_groups[s])
