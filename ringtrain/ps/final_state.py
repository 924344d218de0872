"""The end of a parameter-server run: the servers' parameters, the same on every rank.

    state, tallies = broadcast_final_state(module, plan, topology, rank, server, group)  # sync
    state, tallies = gather_final_state(membership, module, plan, topology, rank, worker,
                                        server, servers_group)                       # async/ssp

Both return the full model state (served parameters, rank 0's buffers) and each server's
figures (`ParameterServer.stats_tensor`, merged by `ringtrain.ps.stats.merge_stats`). Called by
`ringtrain.strategies.ps.PSStrategy.model_state_dict` on every rank (every rank still in the
job, in async/ssp), after every worker finished its last step.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ps.protocol import PSError, PSTopology
from ringtrain.ps.server import ParameterServer
from ringtrain.ps.sharding import ShardPlan, unpack
from ringtrain.ps.worker import PSWorker


def broadcast_final_state(module: nn.Module, plan: ShardPlan, topo: PSTopology, rank: int,
                          server: ParameterServer | None, group: dist.ProcessGroup
                          ) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """sync: every server broadcasts its shard and figures over `group` (every rank)."""
    collectives.barrier(group=group)
    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    params = {n: state[n] for n, _ in plan.shapes}
    tallies = []
    for i, s in enumerate(topo.server_ranks):
        pieces = plan.for_server(i)
        if server is not None and s == rank:
            flat = server.snapshot_flat()
            st = server.stats_tensor()
        else:
            flat = torch.zeros(sum(p.numel for p in pieces))
            st = torch.zeros(8, dtype=torch.float64)
        collectives.broadcast(flat, s, group=group)
        collectives.broadcast(st, s, group=group)
        unpack(flat, pieces, params)
        tallies.append(st.tolist())
    # Buffers and frozen parameters are not served: every rank takes rank 0's.
    for key in sorted(set(state) - set(params)):
        if state[key].is_floating_point() or state[key].dtype in (torch.int64, torch.int32):
            collectives.broadcast(state[key], 0, group=group)
    if server is not None:  # a server's module assembles the final state (workers' is current)
        with torch.no_grad():
            module.load_state_dict(state)
    return state, tallies


def gather_final_state(membership: Any, module: nn.Module, plan: ShardPlan, topo: PSTopology,
                       rank: int, worker: PSWorker | None, server: ParameterServer | None,
                       servers_group: dist.ProcessGroup | None
                       ) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """async/ssp: without collectives over every rank, so a dead worker is no obstacle.

    `membership`: the job's `ringtrain.agreement.membership.Membership`. Two store rounds among
    the ranks still in the job: the first says every live worker has finished (its last push
    applied), so the servers' shards and figures are final; in the second the servers give
    their figures and rank 0 its buffers. Then workers pull the final parameters over their
    own pair groups, and servers swap shards on the servers' group (all servers are alive,
    or the job fails here).
    """
    present = sorted(membership.gather("final/arrived", b"1"))
    missing = [r for r in (0, *topo.server_ranks) if r not in present]
    if missing:
        raise PSError(
            f"rank {rank}: ranks {missing} left the job before its end; the final state "
            "needs rank 0 and every server. Restart from the last snapshot")
    if worker is not None:
        worker.pull()  # nothing is pushed any more: this is the servers' final state
    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    params = {n: state[n] for n, _ in plan.shapes}
    mine: dict[str, Any] = {}
    if server is not None:
        mine["stats"] = server.stats_tensor().tolist()
    if rank == 0:  # buffers and frozen parameters are not served: every rank takes rank 0's
        mine["buffers"] = {k: v for k, v in state.items() if k not in params}
    parts = {r: _loads(b) for r, b in membership.gather("final/figures", _dumps(mine)).items()}
    missing = [r for r in (0, *topo.server_ranks) if r not in parts]
    if missing:
        raise PSError(f"rank {rank}: ranks {missing} left the job while its final state "
                      "was gathered. Restart from the last snapshot")
    for key, value in parts[0]["buffers"].items():
        state[key].copy_(value)
    if server is not None:
        for i, s in enumerate(topo.server_ranks):
            flat = server.snapshot_flat() if s == rank else torch.zeros(plan.server_numel(i))
            if topo.servers > 1:
                collectives.broadcast(flat, s, group=servers_group)
            unpack(flat, plan.for_server(i), params)
        with torch.no_grad():
            module.load_state_dict(state)
    return state, [parts[s]["stats"] for s in topo.server_ranks]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
