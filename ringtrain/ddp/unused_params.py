"""What a synced backward reports about parameters that got no gradient, and when.

Every rank learns, in the same collective, which parameters were unused on which rank (see
`ringtrain/ddp/reducer.py`), so every rank holds the same verdict when that backward ends. With
find_unused_parameters=False a parameter without a gradient is an error; like torch's DDP, the
backward still returns and the error is raised at the start of the next forward with grad
enabled ("Expected to have finished reduction in the prior iteration ..."), on every rank, before
any collective of that forward, so no rank is left waiting. It stays raised until the wrapper is
replaced, as torch's does. The message carries torch's phrases and ringtrain's own: the names and
indices of the parameters, the ranks that had them, and the fix. That backward's gradients are
averaged all the same (a missing one as zero, `Finalize._complete`), so the replicas stay equal.

ringtrain's one addition (`StepGuard`): `optimizer.step()` on the parameters of a wrapper with
such an error pending raises it too, before any parameter changes; torch's DDP lets that step
run on gradients the user did not mean to have, and the error comes one forward later.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ringtrain import collectives


class UnusedParametersError(RuntimeError):
    """A synced backward left parameters without a gradient on some rank."""


def short_list(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... and {len(names) - limit} more' if len(names) > limit else ''}]"


# torch's words (reducer.cpp, ensure_prior_reduction_finished): torch's tests and users' log
# searches match them; ringtrain adds its own summary before them and its fix after.
_TORCH_HEAD = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your module has parameters that were not used in producing "
    "loss. You can enable unused parameter detection by passing the keyword argument "
    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by "
    "making sure all `forward` function outputs participate in calculating loss."
)
_FIX = (
    "With find_unused_parameters=False every parameter that requires grad must get a gradient "
    "on every rank in every synced backward. If some parameters are unused in some steps on "
    "purpose, wrap with DistributedDataParallel(..., find_unused_parameters=True); if they "
    "should never train, set requires_grad=False on them before wrapping; otherwise make "
    "forward's output depend on them."
)
# torch names the parameters only at TORCH_DISTRIBUTED_DEBUG=INFO or DETAIL and says so at OFF;
# ringtrain names them always, and keeps torch's sentence at OFF for those who look for it.
_DEBUG_HINT = (
    " (torch's DDP names these parameters only if you set the environment variable "
    "TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL; ringtrain names them at every level)"
)


def unused_message(rank: int, names: Sequence[str], mine: Sequence[int], bad_ranks: Sequence[int],
                   anywhere: Sequence[int], debug_off: bool = True) -> str:
    """The error text for `rank`: its own unused parameters, or the ranks that had some.

    Args:
        names: every reduced parameter's name, in the reducer's (torch's) index order.
        mine: indices of the parameters that got no gradient on `rank`.
        bad_ranks: the ranks that had such parameters.
        anywhere: indices of the parameters that got no gradient on some rank.
        debug_off: `dist.get_debug_level()` is OFF (adds torch's hint to raise it).
    """
    if mine:
        others = [r for r in bad_ranks if r != rank]
        also = f" (ranks {others} also had unused parameters)" if others else ""
        summary = (f"rank {rank}: {len(mine)} parameter(s) got no gradient in the previous "
                   f"synced backward{also}. ")
        which = (f"\nParameters which did not receive grad for rank {rank}: "
                 f"{', '.join(names[i] for i in mine)}"
                 f"\nParameter indices which did not receive grad for rank {rank}: "
                 f"{' '.join(map(str, mine))}")
    else:  # torch's own rank would wait for the others here; ringtrain knows why
        summary = (f"rank {rank}: ranks {list(bad_ranks)} had parameters that got no gradient "
                   "in the previous synced backward (this rank used all of its own). ")
        which = (f"\nParameters which did not receive grad on ranks {list(bad_ranks)}: "
                 f"{', '.join(names[i] for i in anywhere)}"
                 f"\nParameter indices which did not receive grad on ranks {list(bad_ranks)}: "
                 f"{' '.join(map(str, anywhere))}")
    return f"{summary}{_TORCH_HEAD}{which}\n{_FIX}{_DEBUG_HINT if debug_off else ''}"


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
                 find_unused_parameters: bool) -> tuple[set[int], str | None]:
    """Read the summed status: the parameters that no rank used (their .grad stays untouched),
    and, with find_unused_parameters=False, the error message if any rank missed gradients."""
    n = len(names)
    counts = [round(v) for v in summed.tolist()]
    world_size = len(counts) - n
    bad_ranks = [r for r in range(world_size) if counts[n + r]]
    error = None
    if bad_ranks and not find_unused_parameters:
        anywhere = [i for i in range(n) if counts[i]]
        debug_off = dist.get_debug_level() == dist.DebugLevel.OFF
        error = unused_message(rank, names, mine, bad_ranks, anywhere, debug_off)
    return {i for i in range(n) if counts[i] == world_size}, error


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


class StepGuard:
    """Raises a wrapper's pending unused-parameter error in `optimizer.step()`.

    Between the backward that left parameters without a gradient and the next forward, torch's
    DDP lets an optimizer step run: on gradients the user did not mean to have (torch leaves
    them partly reduced), and one step before the error stops the run. One global step pre-hook
    (`torch.optim.optimizer.register_optimizer_step_pre_hook`, registered when the first error
    is held) checks the reducers with an error pending, held weakly; an optimizer that holds
    any of their parameters raises it, before a parameter changes. Process-wide because the
    hook is: optimizers are built apart from the wrapper, often before it, and may be any
    `torch.optim.Optimizer`.
    """

    def __init__(self) -> None:
        self._pending: weakref.WeakSet = weakref.WeakSet()
        self._handle: Any = None

    def hold(self, reducer: Any) -> None:
        """`reducer` has an error pending (`reducer.raise_unfinished()` raises it)."""
        self._pending.add(reducer)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def release(self, reducer: Any) -> None:
        """`reducer` is done with (its hooks removed): its error no longer stops a step."""
        self._pending.discard(reducer)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._pending:  # the common case: one truth test per step
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for reducer in list(self._pending):
            if any(id(p) in held for p in reducer.params):
                reducer.raise_unfinished()


STEP_GUARD = StepGuard()
