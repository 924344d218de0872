"""A parameter server on torch.distributed: sync, async and stale-synchronous (SSP) training.

    ringtrain train --strategy ps --servers 1 --ps-mode ssp --staleness 2 --nproc-per-node 3

- `sharding`: which server holds which parameters (pure; unit-tested without processes);
- `protocol`: the rank layout, the process groups and the messages;
- `server`: a server rank's shard, optimizer and the three modes;
- `worker`: a worker rank's push of gradients and pull of parameters;
- `stats`: staleness and update-lag figures, merged across servers;
- `final_state`: the end of a run, the servers' parameters gathered on every rank;
- `ringtrain.strategies.ps.PSStrategy`: all of it behind the trainer's `Strategy` seam.
"""

from ringtrain.ps.protocol import PSError, PSTopology, make_ps_groups
from ringtrain.ps.server import MODES, ParameterServer, WorkerLostWarning
from ringtrain.ps.sharding import Piece, ShardPlan, plan_shards
from ringtrain.ps.worker import PSWorker

__all__ = ["MODES", "PSError", "PSTopology", "PSWorker", "ParameterServer", "Piece", "ShardPlan",
           "WorkerLostWarning", "make_ps_groups", "plan_shards"]
