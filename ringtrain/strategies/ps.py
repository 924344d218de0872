"""Parameter server: S server ranks hold the parameters and run the optimizer, W workers train.

    ringtrain train --strategy ps --servers 1 --ps-mode async --nproc-per-node 3
    ringtrain train --strategy ps --servers 1 --ps-mode ssp --staleness 2 --nproc-per-node 3

Ranks 0..W-1 are workers (they read data shards 0..W-1), ranks W..W+S-1 are servers. The
parameter traffic runs on its own two-rank groups (`ringtrain.ps.protocol`), from a thread per
worker on each server, so the world group stays the trainer's.

How this lines up with the trainer's collectives: every rank runs the trainer's loop. A
server's `train_step` returns at once with count 0 and its `eval_logits` returns None, so
servers join the loop's metric all-reduces (contributing 0) while their threads serve; at the
end every rank calls `model_state_dict()`, where the servers broadcast their shards to all.
A trainer that instead parks servers in `serve()` must keep the loop's collectives off the
servers; `serve()` returns once every worker has left or reached `model_state_dict()`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ps.protocol import PSError, PSTopology, make_ps_groups
from ringtrain.ps.server import MODES, ParameterServer
from ringtrain.ps.sharding import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_SPLIT_NUMEL,
    pack,
    plan_shards,
    unpack,
)
from ringtrain.ps.stats import Tally
from ringtrain.ps.worker import PSWorker
from ringtrain.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S, Runtime
from ringtrain.strategies.base import LossFn, OptimizerFn, StepResult, Strategy, eval_forward


class PSStrategy(Strategy):
    """Train through parameter servers in sync, async or SSP mode.

    Args:
        runtime: this process's `Runtime`; world_size = workers + servers.
        servers: how many ranks (the last ones) are servers (--servers).
        mode: "sync" (equal to data parallel on the same global batch), "async" (each gradient
            applied as it arrives) or "ssp" (async, but no worker more than `staleness` steps
            ahead of the slowest) (--ps-mode).
        staleness: SSP's bound k (--staleness); ignored in the other modes.
        split_numel: tensors larger than this are split across servers by rows.
        bucket_numel: push bucket size; each bucket leaves as soon as backward fills it.
        timeout_s: bound on every parameter-server wait; a worker silent for this long is lost.

    .. warning:: In async/ssp the workers' replicas differ between pulls; `model_state_dict()`
       is the servers' state, the same on every rank. The update rule in async/ssp applies
       each worker's gradient with the full learning rate (as MXNet's dist_async does).
    """

    name = "ps"

    def __init__(self, runtime: Runtime, servers: int = 1, mode: str = "sync", staleness: int = 2,
                 *, split_numel: int | None = DEFAULT_SPLIT_NUMEL,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        if mode not in MODES:
            raise ValueError(f"--ps-mode {mode!r}: choose one of {', '.join(MODES)}")
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"--staleness {staleness!r}: SSP's bound must be an integer >= 0")
        if runtime.world_size < 2:
            raise ValueError(
                f"--strategy ps needs at least one worker and one server, but world_size="
                f"{runtime.world_size}; run with --nproc-per-node {servers + 1} or more")
        self.runtime, self.mode, self.staleness = runtime, mode, staleness
        # async/ssp workers drift apart by design: the trainer should not make them agree on
        # anything (SIGTERM) every step, only at metric steps. Servers' parts are per rank.
        self.lockstep = mode == "sync"
        self.replicated_state = False
        self.topology = PSTopology(runtime.world_size, servers)
        self.split_numel, self.bucket_numel, self.timeout_s = split_numel, bucket_numel, timeout_s
        self.groups = make_ps_groups(self.topology, timeout_s)  # every rank, same order
        self.server: ParameterServer | None = None
        self.worker: PSWorker | None = None
        self.module: nn.Module | None = None
        self._stats: dict[str, Any] | None = None
        self._closed = False

    @property
    def is_worker(self) -> bool:
        return not self.topology.is_server(self.runtime.rank)

    @property
    def data_rank(self) -> int | None:
        return self.runtime.rank if self.is_worker else None

    @property
    def data_world_size(self) -> int:
        return self.topology.workers

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        rank, topo = self.runtime.rank, self.topology
        self.loss_fn = loss_fn
        self.plan = plan_shards([(n, p.shape) for n, p in model.named_parameters() if p.requires_grad],
                                topo.servers, self.split_numel)
        empty = [topo.server_ranks[i] for i, n in enumerate(self.plan.loads()) if n == 0]
        if empty:
            raise ValueError(
                f"--servers {topo.servers}: the model's {len(self.plan.pieces)} parameter pieces "
                f"leave servers {empty} with nothing to hold; lower --servers (or split_numel)")
        if topo.is_server(rank):
            self.module = model  # kept on the CPU: it only assembles the final state
            pieces = self.plan.for_server(topo.server_index(rank))
            flat = torch.zeros(sum(p.numel for p in pieces))
            with torch.no_grad():
                pack(dict(model.named_parameters()), pieces, flat)
            self.server = ParameterServer(
                rank, pieces, flat, optimizer_fn, mode=self.mode, staleness=self.staleness,
                pair_groups={w: self.groups.pairs[(rank, w)] for w in topo.worker_ranks},
                server_group=self.groups.servers, timeout_s=self.timeout_s,
                bucket_numel=self.bucket_numel)
            self.server.start()
        else:
            self.module = model.to(self.runtime.device)
            self.worker = PSWorker(
                self.module, self.plan, rank=rank, server_ranks=topo.server_ranks,
                pair_groups={s: self.groups.pairs[(s, rank)] for s in topo.server_ranks},
                bucket_numel=self.bucket_numel)
            self.worker.pull()  # start from the servers' values, whatever the local init was

    # -- training -------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        if self.worker is None:  # a server: its threads do the work, it has nothing to report
            return StepResult(loss_sum=0.0, count=0)
        if not micro_batches:
            raise ValueError(f"worker rank {self.runtime.rank}: train_step got no micro-batches; "
                             "every worker must take part in every step")
        assert self.module is not None, "setup() first"
        start = time.perf_counter()
        device = self.runtime.device
        total = sum(len(x) for x, _ in micro_batches)
        self.module.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = self.loss_fn(self.module(x), y)
            if i == len(micro_batches) - 1:
                # Gradient buckets leave during this backward. Clipping happens on the
                # servers: of the mean gradient in sync (as data parallel clips), of each
                # push by its own norm in async/ssp (each push is an update of its own).
                self.worker.begin_push(lr=lr, grad_clip=grad_clip)
            (loss * (len(x) / total)).backward()  # the accumulated gradient is the step's mean
            loss_sum += float(loss.detach()) * len(x)
        result = self.worker.finish_push()
        elapsed = time.perf_counter() - start
        return StepResult(loss_sum=loss_sum, count=total, compute_s=elapsed - result.comm_s,
                          comm_s=result.comm_s)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.worker is None:
            return None
        assert self.module is not None, "setup() first"
        return eval_forward(self.module, x, self.runtime.device)

    # -- end of run and state ---------------------------------------------------------------------
    def serve(self) -> None:
        """On a server: return once every worker has left or reached `model_state_dict()`."""
        if self.server is not None:
            self.server.wait(until_sync=True)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' parameters (and rank 0's buffers), the same on every rank. Collective.

        Every rank must call it at the same point; workers first finish their step, so every
        push has been applied when the servers broadcast their shards.
        """
        assert self.module is not None, "setup() first"
        group, topo = self.groups.everyone, self.topology
        if self.worker is not None:
            self.worker.sync_point()  # lets a server parked in serve() come here
        dist.barrier(group=group)
        state = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        params = {n: state[n] for n, _ in self.plan.shapes}
        tallies = []
        for i, s in enumerate(topo.server_ranks):
            pieces = self.plan.for_server(i)
            if self.server is not None and s == self.runtime.rank:
                flat = self.server.snapshot_flat()
                st = self.server.stats_tensor()
            else:
                flat = torch.zeros(sum(p.numel for p in pieces))
                st = torch.zeros(8, dtype=torch.float64)
            dist.broadcast(flat, s, group=group)
            dist.broadcast(st, s, group=group)
            unpack(flat, pieces, params)
            tallies.append(st.tolist())
        # Buffers and frozen parameters are not served: every rank takes rank 0's.
        for key in sorted(set(state) - set(params)):
            if state[key].is_floating_point() or state[key].dtype in (torch.int64, torch.int32):
                dist.broadcast(state[key], 0, group=group)
        self._stats = self._merge_stats(tallies)
        if self.worker is None:
            with torch.no_grad():
                self.module.load_state_dict(state)
        return state

    def _merge_stats(self, tallies: list[list[float]]) -> dict[str, Any]:
        gap, lag = Tally(), Tally()
        for t in tallies:
            gap = gap.merge(Tally.from_list(t[0:3]))
            lag = lag.merge(Tally.from_list(t[3:6]))
        # Every server sees every push, so the counts repeat per server: keep max and mean.
        return {"ps_mode": self.mode, "ps_servers": self.topology.servers,
                "ps_staleness_bound": self.staleness if self.mode == "ssp" else None,
                "ps_updates": int(max(t[6] for t in tallies)),
                "ps_workers_lost": int(max(t[7] for t in tallies)),
                **gap.summary("staleness"), **lag.summary("update_lag")}

    def stats(self) -> dict[str, Any]:
        """Observed staleness (steps ahead of the slowest worker) and update lag: max, mean.

        Global after `model_state_dict()` (which gathers the servers' figures); before that,
        this rank's own view.
        """
        if self._stats is not None:
            return dict(self._stats)
        if self.server is not None:
            return {"ps_mode": self.mode, **self.server.stats()}
        gap = self.worker.gap if self.worker is not None else Tally()
        return {"ps_mode": self.mode, **gap.summary("staleness")}

    def state_dict(self) -> dict[str, Any]:
        """A server's shard, optimizer and clocks; a worker's clock. Collective.

        Each rank saves its own part (a snapshot's `per_rank`). The barrier makes it a
        consistent cut: every worker has finished the same step and nothing is in flight, so
        the servers' state is the one the workers' step counter says.
        """
        dist.barrier(group=self.groups.everyone)
        topo = {"servers": self.topology.servers, "workers": self.topology.workers,
                "mode": self.mode}
        if self.server is not None:
            return {"topology": topo, "server": self.server.state_dict()}
        assert self.worker is not None, "setup() first"
        return {"topology": topo, "clock": self.worker.clock}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part, then workers pull the restored parameters. Collective."""
        saved = state["topology"]
        if (saved["servers"], saved["workers"]) != (self.topology.servers, self.topology.workers):
            raise ValueError(
                f"the snapshot was saved with {saved['servers']} servers and {saved['workers']} "
                f"workers, this job has {self.topology.servers} and {self.topology.workers}; "
                "resume with the same --servers and --nproc-per-node")
        dist.barrier(group=self.groups.everyone)  # no push in flight: a server's threads idle
        if self.server is not None:
            self.server.load_state_dict(state["server"])
        dist.barrier(group=self.groups.everyone)  # every shard restored before anyone pulls
        if self.worker is not None:
            self.worker.clock = int(state["clock"])
            self.worker.pull()

    def close(self) -> None:
        """Workers leave; servers wait (bounded) for them, then stop their threads."""
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            try:
                self.worker.leave()
            except RuntimeError as e:  # the server is gone already: nothing left to tell it
                warnings.warn(f"worker rank {self.runtime.rank}: could not tell the servers it "
                              f"left ({str(e).splitlines()[0][:120]})", stacklevel=2)
        if self.server is not None:
            try:
                self.server.wait(timeout_s=min(self.timeout_s, 60.0))
            except PSError as e:
                warnings.warn(str(e), stacklevel=2)
            self.server.close()
