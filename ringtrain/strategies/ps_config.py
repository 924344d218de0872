"""`--strategy ps`'s options and figures: what it checks before any rank starts.

    ringtrain train --strategy ps --servers 1 --ps-mode ssp --staleness 2 --nproc-per-node 3

The strategy itself: `ringtrain/strategies/ps.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtrain.config import int_at_least, option
from ringtrain.errors import ConfigError
from ringtrain.ps.protocol import PSTopology
from ringtrain.ps.server import MODES
from ringtrain.strategies.base import StrategyConfig
from ringtrain.strategies.figures import ADAMW_BYTES, FP32_BYTES, Figures, Workload

__all__ = ["ASYNC_BETA1", "PSConfig", "PSFigures"]

ASYNC_BETA1 = 0.5  # AdamW's beta1 under --ps-mode async (see `PSConfig.trainer_defaults`)


@dataclass(frozen=True, kw_only=True)
class PSFigures(Figures):
    """`--strategy ps`'s figures; the common ones are a worker's (it holds the parameters and
    their gradients, no optimizer state; it pushes the gradients and pulls the parameters)."""

    workers: int
    servers: int
    worker_ranks: tuple[int, ...]  # the first ranks
    server_ranks: tuple[int, ...]  # the last ones
    pull_bytes: float  # the parameters a worker gets back per step (as many as it pushes)
    server_received_bytes: float  # per server per step: its share of every worker's push
    server_held_bytes: float  # per server: its share of parameters, gradients and AdamW state
    staleness_bound: int | None  # steps a worker may run ahead of the slowest; None: no bound
    # Other updates between a gradient's read and its write, with workers at equal speeds:
    # sync 0, async W-1 (each other worker pushes once); None: not estimated (ssp).
    update_lag: float | None


@dataclass(frozen=True, kw_only=True)
class PSConfig(StrategyConfig):
    """`--strategy ps`'s options, and what they mean before any worker starts."""

    servers: int = option(1, "parameter-server ranks, the last ones", type=int_at_least(1))
    mode: str = option("sync", "parameter-server mode", flag="--ps-mode", choices=MODES)
    staleness: int = option(2, "SSP bound (--ps-mode ssp)", type=int_at_least(0))

    def plan(self, world_size: int, step_batch: int) -> int:
        try:  # servers read no data; raises when no worker is left
            return PSTopology(world_size, self.servers).workers
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def tolerated_ranks(self, world_size: int) -> frozenset[int]:
        """`PSTopology.tolerated_ranks` before any worker exists (the launcher needs it)."""
        try:
            topology = PSTopology(world_size, self.servers)
        except ValueError:  # no worker left: the strategy says why at start
            return frozenset()
        return topology.tolerated_ranks(self.mode)

    def trainer_defaults(self) -> dict[str, Any]:
        """AdamW's beta1 0.5 under async: stale gradients already add momentum of their own
        (docs/ps.md); sync and ssp keep 0.9."""
        return {"beta1": ASYNC_BETA1} if self.mode == "async" else {}

    def figures(self, workload: Workload) -> PSFigures:
        """Point to point, every step: each worker pushes its fp32 gradients to the servers
        (each gets its shard) and pulls the new parameters back; the servers hold the
        parameters, gradients and AdamW state split between them (receive buffers left out)."""
        workers, model = self.plan(workload.world_size, workload.step_batch), workload.model_bytes
        topology = PSTopology(workload.world_size, self.servers)
        bound = {"sync": 0, "ssp": self.staleness}.get(self.mode)
        lag = {"sync": 0.0, "async": float(workers - 1)}.get(self.mode)
        per_server = workload.params / self.servers
        return PSFigures(data_ranks=workers, params_bytes=model, grads_bytes=model,
                         optimizer_bytes=0.0, sent_bytes=model, workers=workers,
                         servers=self.servers, worker_ranks=tuple(topology.worker_ranks),
                         server_ranks=tuple(topology.server_ranks), pull_bytes=model,
                         server_received_bytes=workers * model / self.servers,
                         server_held_bytes=per_server * (2 * FP32_BYTES + ADAMW_BYTES),
                         staleness_bound=bound, update_lag=lag)
