"""Parameter server: S server ranks hold the parameters and run the optimizer, W workers train.

    ringtrain train --strategy ps --servers 1 --ps-mode async --nproc-per-node 3
    ringtrain train --strategy ps --servers 1 --ps-mode ssp --staleness 2 --nproc-per-node 3

Ranks 0..W-1 are workers (they read data shards 0..W-1), ranks W..W+S-1 are servers. The
parameter traffic runs on its own two-rank groups (`ringtrain.ps.protocol`), from a thread per
worker on each server, so the world group stays the trainer's.

How this lines up with the trainer's collectives: every rank runs the trainer's loop. A
server's `train_step` returns at once with count 0 and its `eval_logits` returns None, so
servers join the loop's metric sums (contributing 0) while their threads serve; at the end
every rank calls `model_state_dict()`, where (sync) the servers broadcast their shards to all,
or (async/ssp) the workers pull them after a store round among the ranks still in the job.

A worker that dies in async/ssp mode is dropped and the job goes on (`tolerated_ranks`): the
server that lost it (or the watchdog, via `drop_worker`) marks it departed in the job's
`Membership`, which the trainer's store-based metric sums read, and the end-of-run state is
gathered among the ranks still in the job. Rank 0 (it reports) and the servers (they hold the
only copy of the parameters) are never tolerated: their loss still ends the job. Its options
and figures: `ringtrain/strategies/ps_config.py`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.agreement.base import Agreement
from ringtrain.agreement.membership import Membership
from ringtrain.agreement.store import StoreAgreement
from ringtrain.errors import ConfigError
from ringtrain.ps.final_state import broadcast_final_state, gather_final_state
from ringtrain.ps.protocol import PSError, PSTopology, make_ps_groups
from ringtrain.ps.server import MODES, ParameterServer
from ringtrain.ps.sharding import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_SPLIT_NUMEL,
    pack,
    plan_shards,
)
from ringtrain.ps.stats import Tally, merge_stats
from ringtrain.ps.worker import PSWorker
from ringtrain.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S, Runtime
from ringtrain.strategies import portable
from ringtrain.strategies.base import (
    EvalShard,
    StepResult,
    Strategy,
    eval_forward,
)
from ringtrain.strategies.ps_config import PSConfig
from ringtrain.strategies.ps_portable import named_state, piece_state
from ringtrain.strategies.step import accumulate
from ringtrain.types import LossFn, OptimizerFn

log = logging.getLogger("ringtrain")


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
        scope: names the store keys of async/ssp's membership view (`Membership.of`), the same
            on every rank; a second async/ssp strategy in one process group needs another.

    .. warning:: In async/ssp the workers' replicas differ between pulls; `model_state_dict()`
       is the servers' state, the same on every rank. The update rule in async/ssp applies
       each worker's gradient with the full learning rate (as MXNet's dist_async does).
    """

    name = "ps"
    Config = PSConfig

    def __init__(self, runtime: Runtime, servers: int = 1, mode: str = "sync", staleness: int = 2,
                 *, split_numel: int | None = DEFAULT_SPLIT_NUMEL,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, scope: str = "ps"):
        if mode not in MODES:
            raise ConfigError(f"--ps-mode {mode!r}: choose one of {', '.join(MODES)}")
        if not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"--staleness {staleness!r}: SSP's bound must be an integer >= 0")
        if runtime.world_size < 2:
            raise ConfigError(
                f"--strategy ps needs at least one worker and one server, but world_size="
                f"{runtime.world_size}; run with --nproc-per-node {servers + 1} or more")
        self.runtime, self.mode, self.staleness = runtime, mode, staleness
        self.replicated_state = False  # servers' parts are per rank
        try:
            self.topology = PSTopology(runtime.world_size, servers)
        except ValueError as e:  # no worker left: the same on every rank
            raise ConfigError(str(e)) from None
        self.split_numel, self.bucket_numel, self.timeout_s = split_numel, bucket_numel, timeout_s
        self.groups = make_ps_groups(self.topology, timeout_s)  # every rank, same order
        # async/ssp go on without a dead worker: who is still in the job is kept in the store.
        self.membership: Membership | None = None
        if mode != "sync":
            self.membership = Membership.of(runtime, scope, timeout_s=timeout_s)
        self.server: ParameterServer | None = None
        self.worker: PSWorker | None = None
        self.module: nn.Module | None = None
        self._stats: dict[str, Any] | None = None
        self._closed = False

    @property
    def data_rank(self) -> int | None:
        return None if self.topology.is_server(self.runtime.rank) else self.runtime.rank

    @property
    def data_world_size(self) -> int:
        return self.topology.workers

    @property
    def tolerated_ranks(self) -> frozenset[int]:
        """Ranks whose death the job survives: async/ssp workers other than rank 0."""
        return self.topology.tolerated_ranks(self.mode)

    def agreement(self, runtime: Runtime, name: str) -> Agreement:
        """async/ssp workers drift apart by design, and may die: they agree through the store,
        over the ranks still in the job, and vote (SIGTERM) at metric steps only."""
        if self.mode == "sync":
            return super().agreement(runtime, name)
        return StoreAgreement(Membership.of(runtime, name, timeout_s=self.timeout_s))

    def eval_shard(self) -> EvalShard | None:
        """async/ssp: replicas differ and a worker may leave, so worker rank 0 evaluates the
        whole set alone, on the parameters its last step brought back (no collective)."""
        if self.mode == "sync":
            return super().eval_shard()
        return EvalShard(0, 1) if self.data_rank == 0 else None

    def rank_departed(self, rank: int, why: str) -> None:
        self.drop_worker(rank, why)

    def drop_worker(self, rank: int, why: str) -> bool:
        """Mark worker `rank` departed (a watchdog found it dead); warns once per job.

        Returns True when this call was the first to report it.
        """
        if self.membership is None or rank not in self.tolerated_ranks:
            raise ValueError(f"rank {rank} is not a tolerated worker of this {self.mode} job "
                             f"(tolerated: {sorted(self.tolerated_ranks)})")
        live = [w for w in self.membership.live(self.topology.worker_ranks) if w != rank]
        message = (f"worker rank {rank} died ({why}); parameter-server {self.mode} training goes "
                   f"on with workers {live}")
        first = self.membership.depart(rank, message)
        if first:
            log.warning("warning: %s", message)
        if self.server is not None:  # e.g. frozen: its connection may stay open for minutes
            self.server.drop(rank, why)
        return first

    def _on_lost(self, rank: int, message: str) -> bool:
        """A server dropped worker `rank`: tell every rank; True (warn) if it is the first to."""
        assert self.membership is not None
        return self.membership.depart(rank, message)

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        rank, topo = self.runtime.rank, self.topology
        self.loss_fn = loss_fn
        self.shards = plan_shards([(n, p.shape) for n, p in model.named_parameters()
                                   if p.requires_grad],
                                  topo.servers, self.split_numel)
        empty = [topo.server_ranks[i] for i, n in enumerate(self.shards.loads()) if n == 0]
        if empty:
            raise ConfigError(
                f"--servers {topo.servers}: the model's {len(self.shards.pieces)} parameter pieces "
                f"leave servers {empty} with nothing to hold; lower --servers (or split_numel)")
        if topo.is_server(rank):
            self.module = model  # kept on the CPU: it only assembles the final state
            pieces = self.shards.for_server(topo.server_index(rank))
            flat = torch.zeros(sum(p.numel for p in pieces))
            with torch.no_grad():
                pack(dict(model.named_parameters()), pieces, flat)
            self.server = ParameterServer(
                rank, pieces, flat, optimizer_fn, mode=self.mode, staleness=self.staleness,
                pair_groups={w: self.groups.pairs[(rank, w)] for w in topo.worker_ranks},
                server_group=self.groups.servers, timeout_s=self.timeout_s,
                bucket_numel=self.bucket_numel,
                on_lost=self._on_lost if self.membership is not None else None)
            self.server.start()
        else:
            self.module = model.to(self.runtime.device)
            self.worker = PSWorker(
                self.module, self.shards, rank=rank, server_ranks=topo.server_ranks,
                pair_groups={s: self.groups.pairs[(s, rank)] for s in topo.server_ranks},
                bucket_numel=self.bucket_numel, tracer=self.tracer)
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
        self.module.zero_grad(set_to_none=True)
        worker = self.worker
        # Gradient buckets leave during the last backward. Clipping happens on the servers: of
        # the mean gradient in sync (as data parallel clips), of each push by its own norm in
        # async/ssp (each push is an update of its own).
        acc = accumulate(micro_batches, self.module, self.loss_fn, device=self.runtime.device,
                         tracer=self.tracer,
                         before_last_backward=lambda: worker.begin_push(lr=lr, grad_clip=grad_clip))
        result = self.worker.finish_push()
        elapsed = time.perf_counter() - start
        return StepResult(loss_sum=acc.loss_sum, count=acc.count, compute_s=elapsed - result.comm_s,
                          comm_s=result.comm_s)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.worker is None:
            return None
        assert self.module is not None, "setup() first"
        return eval_forward(self.module, x, self.runtime.device)

    # -- end of run and state ---------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' parameters (and rank 0's buffers), the same on every rank. Collective.

        Every rank must call it at the same point; workers first finish their step, so every
        push has been applied when the servers broadcast their shards. In async/ssp, "every
        rank" is every rank still in the job: the dead are left out.
        """
        assert self.module is not None, "setup() first"
        group, topo = self.groups.everyone, self.topology
        if self.worker is not None:
            self.worker.sync_point()  # a server in `ParameterServer.wait(until_sync=True)` returns
        if self.membership is not None:
            state, tallies = gather_final_state(
                self.membership, self.module, self.shards, topo, self.runtime.rank, self.worker,
                self.server, self.groups.servers)
        else:
            state, tallies = broadcast_final_state(self.module, self.shards, topo,
                                                   self.runtime.rank, self.server, group)
        self._stats = merge_stats(tallies, mode=self.mode, servers=topo.servers,
                                  staleness=self.staleness)
        return state

    def stats(self) -> dict[str, Any]:
        """Observed staleness (steps ahead of the slowest worker) and update lag: max, mean.

        Global after `model_state_dict()` (which gathers the servers' figures); before that,
        this rank's own view.
        """
        departed = ({} if self.membership is None
                    else {"departed_ranks": sorted(self.membership.departed())})
        if self._stats is not None:
            return {**self._stats, **departed}
        if self.server is not None:
            return {"ps_mode": self.mode, **self.server.stats(), **departed}
        gap = self.worker.gap if self.worker is not None else Tally()
        return {"ps_mode": self.mode, **gap.summary("staleness"), **departed}

    def state_dict(self) -> dict[str, Any]:
        """A server's shard, optimizer and clocks; a worker's clock. Collective.

        Each rank saves its own part (a snapshot's `per_rank`). Two barriers make it a
        consistent cut: after the first, every worker has finished the same step and nothing is
        in flight; the second holds the workers until the servers have copied their state, so
        no push of the next step lands in it (the servers' state is the one the workers' step
        counter says).
        """
        collectives.barrier(group=self.groups.everyone)
        topo = {"servers": self.topology.servers, "workers": self.topology.workers,
                "mode": self.mode}
        if self.server is not None:
            state = {"topology": topo, "server": self.server.state_dict()}
        else:
            assert self.worker is not None, "setup() first"
            state = {"topology": topo, "clock": self.worker.clock}
        collectives.barrier(group=self.groups.everyone)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part, then workers pull the restored parameters. Collective."""
        saved = state["topology"]
        if (saved["servers"], saved["workers"]) != (self.topology.servers, self.topology.workers):
            raise ValueError(
                f"the snapshot was saved with {saved['servers']} servers and {saved['workers']} "
                f"workers, this job has {self.topology.servers} and {self.topology.workers}; "
                "resume with the same --servers and --nproc-per-node")
        # no push in flight: a server's threads idle
        collectives.barrier(group=self.groups.everyone)
        if self.server is not None:
            self.server.load_state_dict(state["server"])
        collectives.barrier(group=self.groups.everyone)  # every shard restored before anyone pulls
        if self.worker is not None:
            self.worker.clock = int(state["clock"])
            self.worker.pull()

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The servers' parameters and optimizer state, their pieces joined (`ps_portable`)."""
        parts = read_parts(list(range(int(metadata["world_size"]))))
        servers = [parts[r]["server"] for r in sorted(parts) if "server" in parts[r]]
        if any("param_pieces" not in s for s in servers):
            raise ConfigError("this ps snapshot was written by a ringtrain that did not name its "
                              "optimizer's pieces: resume it with --strategy ps and its layout")
        return portable.make(*named_state(servers))

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        """Servers take their pieces of the form, then workers pull them. Collective; every rank
        checks the model first, so a wrong one is refused on all ranks alike."""
        assert self.module is not None, "setup() first"
        portable.check(state)
        portable.load_model(self.module, state["model"])  # buffers, and the names checked
        collectives.barrier(group=self.groups.everyone)  # no push in flight
        if self.server is not None:
            self.server.load_pieces(*piece_state(state["model"], state["optimizer"]["state"],
                                                 self.server.pieces, self.server.param_pieces()))
        collectives.barrier(group=self.groups.everyone)  # every shard loaded before a pull
        if self.worker is not None:
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

