"""What a synced backward reports about parameters that got no gradient.

Every rank learns, in the same collective, which parameters were unused on which rank (see
`ringtrain/ddp/reducer.py`), so the error below is raised on all ranks in the same backward and
names the parameters and the ranks, with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import collectives


class UnusedParametersError(RuntimeError):
    """A synced backward left parameters without a gradient on some rank."""


def short_list(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... and {len(names) - limit} more' if len(names) > limit else ''}]"


def unused_message(rank: int, names: Sequence[str], mine: Sequence[int], bad_ranks: Sequence[int],
                   anywhere: Sequence[int]) -> str:
    """The error text for `rank`: its own unused parameters, or the ranks that had some."""
    fix = (
        "With find_unused_parameters=False every parameter that requires grad must get a "
        "gradient on every rank in every synced backward. If some parameters are unused in "
        "some steps on purpose, wrap with DistributedDataParallel(..., "
        "find_unused_parameters=True); if they should never train, set requires_grad=False "
        "on them before wrapping; otherwise make forward's output depend on them."
    )
    if mine:
        others = [r for r in bad_ranks if r != rank]
        also = f" (ranks {others} also had unused parameters)" if others else ""
        return (f"rank {rank}: {len(mine)} parameter(s) got no gradient in this backward: "
                f"{short_list([names[i] for i in mine])}{also}. {fix}")
    return (f"rank {rank}: ranks {list(bad_ranks)} had parameters that got no gradient in this "
            f"backward: {short_list([names[i] for i in anywhere])}. {fix}")


# The status all ranks sum at the end of a synced backward: n per-parameter slots (1 where the
# parameter got no gradient on this rank), then world_size per-rank slots (1 on this rank's
# slot if it had any). After the sum: how many ranks missed each parameter, and which ranks.


def fill_status(status: torch.Tensor, unused: Sequence[int], n_params: int,
                rank: int) -> torch.Tensor:
    """Write this rank's part of the status into `status` (n_params + world_size slots)."""
    status.zero_()
    if unused:
        status[list(unused)] = 1
        status[n_params + rank] = 1
    return status


def check_unused(summed: torch.Tensor, rank: int, names: Sequence[str], mine: Sequence[int],
                 raise_error: bool) -> set[int]:
    """Read the summed status: raise `UnusedParametersError` if asked and any rank missed
    gradients, else return the parameters that no rank used (their .grad stays untouched)."""
    n = len(names)
    counts = [round(v) for v in summed.tolist()]
    world_size = len(counts) - n
    bad_ranks = [r for r in range(world_size) if counts[n + r]]
    if bad_ranks and raise_error:
        anywhere = [i for i in range(n) if counts[i]]
        raise UnusedParametersError(unused_message(rank, names, mine, bad_ranks, anywhere))
    return {i for i in range(n) if counts[i] == world_size}


class StatusBuffer:
    """The status of a backward whose buckets did not carry it: one small all-reduce of its own.

    One buffer for the reducer's life, never a temporary: gloo's worker thread drops its
    reference to a Work (and its tensors) a moment after the work completes; a tensor whose
    Python object died first hands that object to C++, and its last release then needs the GIL
    on the worker thread, which aborts the process during interpreter exit.
    """

    def __init__(self, n_params: int, world_size: int, device: torch.device):
        self.n_params, self.world_size, self.device = n_params, world_size, device
        self._buffer: torch.Tensor | None = None

    def launch(self, unused: Sequence[int], rank: int,
               group: dist.ProcessGroup) -> tuple[torch.Tensor, Any]:

        """Fill this rank's status and start its all-reduce: (the buffer, the work)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.n_params + self.world_size, dtype=torch.int32,
                                       device=self.device)
        status = fill_status(self._buffer, unused, self.n_params, rank)
        return status, collectives.all_reduce(status, group=group, async_op=True)
