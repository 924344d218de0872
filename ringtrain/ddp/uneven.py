"""The reducer's part in uneven inputs (`join.py`): a joined rank's shadow backward, the divisor.

Under torch's `Join` context manager a rank that ran out of batches ("joined") keeps matching
the collectives of the ranks still training, or they would wait forever in their next
all-reduce. For each synced backward of theirs it runs `shadow_backward()`: every bucket's
all-reduce (or comm hook) with zeros, on the same lane and in the same order as `Reducer._launch`
issues them, and the unused-parameter status where `Finalize._complete` sends it (riding in the
last bucket, or alone after the buckets). It also follows the same bucket rebuild: a joined rank
counts its shadow backwards as synced rounds, so the one-time rebuild broadcast
(`_rebuild_buckets`) is due in the same round on every rank, even on a rank that never trained
(torch shadows that broadcast too).

A joined rank contributes zero gradients. With `Join(divide_by_initial_world_size=True)` (the
default) the ranks still training divide by the world size all the same, so every sample weighs
the same; with False they divide by the number of ranks still training, which Join's own
all-reduce at the start of their forward counts (`divide_by`), as torch's reducer does.

This is a base class of `Reducer`, like `Finalize`: it reads the state listed below.
Tests: `.venv/bin/pytest -q tests/test_ddp_join.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp import buckets
from ringtrain.ddp.buckets import Bucket, GradBucket


class UnevenInputs:
    """A joined rank's shadow backward and the divisor of a round (a base class of `Reducer`)."""

    # Set by Reducer.__init__ (and Reducer._build for the buckets).
    params: list[nn.Parameter]
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    lanes: list[dist.ProcessGroup]
    comm_hook: Callable[[Any, GradBucket], torch.futures.Future] | None
    comm_hook_state: Any
    buckets: list[Bucket]
    _observed: list[int] | None
    _last_unused: list[int] | None
    _next_order: list[int] | None
    _rebuild_buckets: Callable[[], bool]

    _count_work: Any = None  # Join's "not joined yet" all-reduce of this round's forward
    _count: int | None = None  # ranks still training this round; None: the world size
    _shadow_status: torch.Tensor | None = None
    _shadow_kept: tuple = ()  # the last shadow round's tensors and works (see below)

    # ---- the divisor --------------------------------------------------------------------

    def divide_by(self, work: Any) -> None:
        """Average the next synced backward over the count an all-reduce gives, not the world.

        `work` is Join's all-reduce of ones over the ranks not joined yet (started at the
        beginning of the forward); None: divide by the world size. Read when the first gradient
        is averaged, so the all-reduce overlaps the forward.
        """
        self._count_work, self._count = work, None

    def _divisor(self) -> int:
        if self._count_work is not None:
            work, self._count_work = self._count_work, None
            work.wait()
            self._count = max(1, round(work.result()[0].item()))
        return self._count or self.world_size

    # ---- a joined rank's backward ---------------------------------------------------------

    def shadow_backward(self) -> None:
        """Issue the collectives of one synced backward with zero gradients; `.grad` untouched.

        The status repeats the parameters this rank missed in its last synced backward (all of
        them if it never trained), as torch's joined rank all-reduces the used-parameter map
        its last iteration left: a parameter this rank used before it joined still counts as
        used, so its `.grad` is written (zeros where no training rank used it) as in torch. It
        also says this rank is not at fault, so find_unused_parameters=False raises only for
        the training ranks' parameters.
        """
        self._rebuild_buckets()  # as the training ranks' prepare_for_backward (a no-op if done)
        n, hook = len(self.params), self.comm_hook
        kept: list = []
        pending = []  # works (default) or futures (comm hook), in launch order
        carried = False
        for bucket in self.buckets:
            members = [self.params[i] for i in bucket.members]
            numel = sum(p.numel() for p in members)
            first = members[0]
            if hook is None:
                if self.world_size == 1:
                    continue
                tail = 0 if bucket.tail is None else bucket.tail.numel()
                zeros = torch.zeros(numel + tail, dtype=first.dtype, device=first.device)
                if tail:  # the last bucket carries the status (Reducer._launch)
                    self._fill_joined_status(zeros[numel:numel + n])
                    carried = True
                lane = self.lanes[bucket.index % len(self.lanes)]
                pending.append(collectives.all_reduce(zeros, group=lane, async_op=True))
            else:
                zeros = torch.zeros(numel, dtype=first.dtype, device=first.device)
                views = [v.view(p.shape) for v, p in
                         zip(zeros.split([p.numel() for p in members]), members, strict=True)]
                stand_in = dataclasses.replace(bucket, buffer=zeros, gradients=views)
                pending.append(buckets.call_hook(hook, self.comm_hook_state, stand_in, members,
                                                 is_last=bucket.index == len(self.buckets) - 1))
            kept.append(zeros)
        alone = self.world_size > 1 and not carried
        status_work = self._shadow_status_launch() if alone and hook is None else None
        for item in pending:
            item.wait()
        if alone and hook is not None:  # after the hooks' futures, as Finalize._complete does
            status_work = self._shadow_status_launch()
        if status_work is not None:
            status_work.wait()
        # Kept until the next shadow round, never dropped right away: gloo's worker thread
        # releases a work a moment after it completes, and a tensor whose Python object died
        # first would need the GIL on that thread (see Finalize._reset).
        self._shadow_kept = (*kept, *pending, status_work)
        if self._observed is not None:  # this rank's first synced round, shadowed
            self._observed = None
            self._next_order = [i for bucket in self.buckets for i in bucket.members]

    def _fill_joined_status(self, per_param: torch.Tensor) -> None:
        if self._last_unused is None:
            per_param.fill_(1)
        elif self._last_unused:
            per_param[self._last_unused] = 1

    def _shadow_status_launch(self) -> Any:
        """Start the status all-reduce a round sends alone (`StatusBuffer`'s shape and dtype)."""
        n = len(self.params)
        if self._shadow_status is None:
            self._shadow_status = torch.empty(n + self.world_size, dtype=torch.int32,
                                              device=self.params[0].device)
        status = self._shadow_status
        status.zero_()
        self._fill_joined_status(status[:n])
        return collectives.all_reduce(status, group=self.process_group, async_op=True)
