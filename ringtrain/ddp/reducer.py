"""The bucketed gradient all-reduce behind `ringtrain.DistributedDataParallel`.

How one synced backward goes (the design torch's DDP paper describes, Li et al., VLDB 2020):
each parameter's post-accumulate-grad hook marks it ready and stages its gradient in its bucket;
when the last gradient of bucket k arrives and buckets 0..k-1 are out, bucket k's all-reduce is
launched asynchronously, so communication overlaps the rest of backward. A callback queued on
the autograd engine runs when backward ends: it stages what never fired (parameters accumulated
under `no_sync`, unused ones), waits for every bucket, checks unused parameters on all ranks at
once and copies the averaged gradients back. `loss.backward()` returns only after that, so the
optimizer always steps on synced gradients.

Buckets launch strictly in index order on every rank: collectives on one process group must be
issued in the same order everywhere, and gradients can arrive in a different order on different
ranks. The first plan assumes reverse registration order; after the first synced backward the
buckets are rebuilt once from the order rank 0 actually saw, as torch's reducer does.

This file holds the bucket plan, the hooks and the launch, and the start of a synced round
(`prepare_for_backward`); how a round ends (the end-of-backward callback, waiting, unused
parameters, writing back; `sync_gradients`, `defer`/`flush`) is in `finalize.py`, the
`Finalize` base class. Tests: `.venv/bin/pytest -q tests/test_ddp.py`."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp import buckets
from ringtrain.ddp.buckets import (
    Bucket,
    GradBucket,
    assign_buckets,
    build_buckets,
    status_carrier_last,
)
from ringtrain.ddp.finalize import Finalize
from ringtrain.ddp.framework_members import ReducerFrameworkMembers
from ringtrain.ddp.static_graph import StaticGraphCheck
from ringtrain.ddp.torch_members import ReducerTorchMembers
from ringtrain.ddp.uneven import UnevenInputs
from ringtrain.ddp.unused_params import STEP_GUARD, StatusBuffer, fill_status
from ringtrain.torch_internals import (
    backward_tls_free,
    queue_backward_callback,
)
from ringtrain.trace import COMM, NO_TRACE, Tracer


def _grad_ready(reducer_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    # A weak reference: the hooks live on the user's parameters and must neither keep a dropped
    # wrapper alive nor act for it.
    reducer = reducer_ref()
    if reducer is not None:
        with backward_tls_free():  # it may launch a bucket's all-reduce
            reducer._on_grad(index)


def _finalize(reducer_ref: weakref.ref) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        with backward_tls_free():
            reducer._finalize()


class Reducer(Finalize, UnevenInputs, ReducerFrameworkMembers, ReducerTorchMembers):
    """Averages the gradients of `params` over `process_group` during backward.

    Args:
        params: the parameters that require grad, in registration order (every rank the same).
        names: their qualified names, for error messages.
        process_group: the group to average over.
        bucket_cap_bytes / first_bucket_bytes / solo_bytes: the bucket plan (see `assign_buckets`).
        find_unused_parameters: parameters without a gradient count as zero instead of raising
            (and a hook that fires while `.grad` is None counts as no gradient, as in torch).
        gradient_as_bucket_view: leave `.grad` as a view into the bucket instead of copying back.
        lanes: groups over the same ranks as `process_group` (itself first); bucket i is
            all-reduced on lane i % len(lanes), so buckets travel concurrently (`lanes.py`).
        bucket_caps: per-bucket caps in bytes (torch's bucket_cap_mb_list), or None.
        skip_all_reduce_unused_params: a bucket whose parameters all got no gradient on this
            rank is not all-reduced (torch's flag: every rank must have the same unused ones).
        rebuild_buckets: rebuild the buckets once, in the order the first synced backward
            produced the gradients. torch's DDP does not with find_unused_parameters=True (but
            does with static_graph=True); DistributedDataParallel follows it.
        tracer: records each bucket's communication and the end-of-backward wait
            (`ringtrain.trace`; default: nothing).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        *,
        bucket_cap_bytes: int,
        first_bucket_bytes: int,
        solo_bytes: int | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        lanes: Sequence[dist.ProcessGroup] | None = None,
        tracer: Tracer = NO_TRACE,
        bucket_caps: Sequence[int] | None = None,
        skip_all_reduce_unused_params: bool = False,
        rebuild_buckets: bool = True,
    ):
        self.params, self.names, self.tracer = list(params), list(names), tracer
        self.process_group = process_group
        self.rank, self.world_size = process_group.rank(), process_group.size()
        self.lanes = list(lanes) if lanes else [process_group]
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.comm_hook: Callable[[Any, GradBucket], torch.futures.Future] | None = None
        self.comm_hook_state: Any = None
        self.expect_sync = False  # set by a forward that wants this backward synced
        self.static_graph: StaticGraphCheck | None = None  # set by DDP(static_graph=True)

        self._plan_args = dict(bucket_cap_bytes=bucket_cap_bytes,
                               first_bucket_bytes=first_bucket_bytes, solo_bytes=solo_bytes,
                               bucket_caps=bucket_caps)
        self._build(order=None)
        # Like torch's reducer, the buckets are rebuilt once, from the order in which the first
        # synced backward actually produced the gradients (rank 0's, so all ranks agree).
        self._observed: list[int] | None = [] if rebuild_buckets else None
        self._next_order: list[int] | None = None
        self._init_framework_members()  # what frameworks call on torch's reducer

        self._ready = bytearray(len(self.params))  # staged this round
        self._unused: list[int] = []  # staged without a gradient this round
        # The unused-parameter status, when no bucket carries it.
        self._status = StatusBuffer(len(self.params), self.world_size, self.buckets[0].flat.device)
        self._retired: list = []  # the last round's works, see _reset
        self._accumulated = bytearray(len(self.params))  # got a gradient under no_sync
        self._next = 0  # the next bucket to launch
        self._hold = False  # stage without launching (sync_gradients picks its own order)
        self._queued = False  # the end-of-backward callback is queued
        self._defer = False  # the next synced backward stages only; flush() sends (see defer())
        self._deferred = False  # a deferred backward ended: its buckets wait for flush()
        self.staging_s = 0.0  # time the last deferred backward spent in this reducer's hooks
        self.num_buckets_reduced = 0  # in the last synced backward (torch's logging counter)
        self.last_error: str | None = None  # the last error a synced round raised
        # An unused parameter's error, raised at the next synced forward (finalize.py).
        self.unfinished_error: str | None = None
        me = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, i))
            for i, p in enumerate(self.params)
        ]
        weakref.finalize(self, _remove_all, self._handles)

    def _build(self, order: list[int] | None) -> None:
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        plan = assign_buckets(sizes, keys, order=order, **self._plan_args)
        plan, carried = status_carrier_last(plan, sizes, [p.dtype for p in self.params],
                                            world_size=self.world_size,
                                            solo_bytes=self._plan_args["solo_bytes"])
        if order is not None and plan == [b.members for b in self.buckets]:
            return
        # Status slots: per parameter "got no gradient here", then per rank "had such params".
        self.buckets = build_buckets(
            self.params, plan,
            status_slots=len(self.params) + self.world_size
            if self.world_size > 1 and carried else 0)

        self._bucket_of = [0] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.members):
                self._bucket_of[i], self._slot_of[i] = bucket.index, slot

    def _rebuild(self, order: list[int]) -> None:
        if self.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=self.buckets[0].flat.device)
            src = (0 if self.process_group == dist.group.WORLD
                   else dist.get_global_rank(self.process_group, 0))
            collectives.broadcast(agreed, src, group=self.process_group)
            order = agreed.tolist()
        self._build(order)

    # ---- during backward -------------------------------------------------------------------

    def _on_grad(self, i: int) -> None:
        if not self.expect_sync:
            self._accumulated[i] = 1  # no_sync: keep it local, reduce it at the next sync
            return
        if not self._queued:
            self._queued = True
            queue_backward_callback(functools.partial(_finalize, weakref.ref(self)))
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]!r} got a second gradient in one synced backward, after "
                "its first was already being averaged: it is used in several reentrant backward "
                "passes (torch.utils.checkpoint(..., use_reentrant=True) around code that uses it "
                "more than once, or inside and outside the checkpoint). Use "
                "torch.utils.checkpoint(..., use_reentrant=False)."
            )
        if self._observed is not None:
            self._observed.append(i)
        if self.params[i].grad is None and self.find_unused_parameters:
            # The hook fired with no gradient (the output that led here got an undefined one):
            # as in torch, not a use, so a parameter no rank used keeps .grad None.
            self._unused.append(i)  # before staging: the last bucket's launch reads it
            self._mark_ready(i, None, used=False)
            return
        if self._defer:
            t0 = time.perf_counter()
            self._mark_ready(i, self.params[i].grad, used=True, hot=True)
            self.staging_s += time.perf_counter() - t0
            return
        self._mark_ready(i, self.params[i].grad, used=True, hot=True)

    def _mark_ready(self, i: int, grad: torch.Tensor | None, used: bool, hot: bool = False) -> None:
        self._ready[i] = 1
        bucket = self.buckets[self._bucket_of[i]]
        buckets.stage(bucket, self._slot_of[i], self.params[i], grad, used=used, hot=hot,
                      scale=self._scale(), as_view=self.gradient_as_bucket_view)
        bucket.pending -= 1
        # Launch in index order only: every rank must issue the same collectives in the same order.
        while (not self._hold and not self._defer and self._next < len(self.buckets)
               and self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _scale(self) -> float | None:
        # The default path averages: coalesced gradients are scaled as they are copied into the
        # bucket (one pass, as torch does), in-place ones after the sum. A comm hook owns the
        # averaging (torch's hooks divide by the group size themselves).
        # Under Join(divide_by_initial_world_size=False), over the ranks still training.
        return None if self.comm_hook is not None or self.world_size == 1 else 1.0 / self._divisor()

    def _launch(self, bucket: Bucket) -> None:
        if self.skip_all_reduce_unused_params and set(bucket.members) <= set(self._unused):
            return  # nothing used here, on any rank (torch's flag promises it): nothing to send
        self.num_buckets_reduced += 1
        if self.comm_hook is None:
            if self.world_size > 1:
                sent = bucket.buffer
                if bucket.tail is not None and not bucket.in_place:
                    # The last bucket: every parameter is staged by now, so the status is final.
                    fill_status(bucket.tail, self._unused, len(self.params), self.rank)
                    sent, bucket.tail_sent = bucket.flat, True
                lane = self.lanes[bucket.index % len(self.lanes)]
                bucket.work = collectives.all_reduce(sent, group=lane, async_op=True)
        else:
            bucket.fut = buckets.call_hook(self.comm_hook, self.comm_hook_state, bucket,
                                           [self.params[i] for i in bucket.members],
                                           is_last=bucket.index == len(self.buckets) - 1)
        if self.tracer.active:  # from launch to the collective's completion
            self.tracer.until_done(f"bucket {bucket.index}", COMM, bucket.work or bucket.fut,
                                   bytes=bucket.buffer.numel() * bucket.buffer.element_size())

    # ---- control ---------------------------------------------------------------------------

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] | torch.Tensor = ()) -> None:
        """Called by a forward whose backward must be synced (and by frameworks, outside one).

        Args:
            outputs: torch's signature: the forward's outputs, from which torch's reducer finds
                unused parameters by walking the graph. Ignored here: this reducer finds them
                when backward ends (the parameters whose hook never fired). Lightning's manual
                optimization passes the loss, accelerate's trigger_sync_in_backward `[]`.
        """
        self.raise_unfinished()  # as torch's: the previous round left unused parameters
        self._retired = []  # long done on gloo's side: released here, with the GIL
        self.num_buckets_reduced = 0
        if self._deferred:
            raise RuntimeError("a deferred backward's gradients were never sent: call "
                               "reducer.flush() after it, before the next forward")
        if self.expect_sync and any(self._ready) and not self._queued:
            self._reset()
            raise RuntimeError(
                "the previous backward's gradients were never averaged: its first gradients came "
                "inside a reentrant backward (torch.utils.checkpoint(..., use_reentrant=True)) "
                "and no gradient came after it to mark the end of the outer backward. Use "
                "torch.utils.checkpoint(..., use_reentrant=False)."
            )
        if self._queued:  # a previous backward failed before its end callback ran
            self._reset()
        self._rebuild_buckets()  # once, after the first synced backward
        self._count_round()  # framework_members.py: _get_ddp_logging_data's figures
        if self.static_graph is not None:
            try:
                self.static_graph.before_round()  # raises once after a changed graph, as torch
            except RuntimeError as e:
                self.last_error = str(e)
                raise
        self.expect_sync = True

    def remove_hooks(self) -> None:
        _remove_all(self._handles)
        STEP_GUARD.release(self)  # done with: a new wrapper of the same parameters may step


def _remove_all(handles: list) -> None:
    while handles:
        handles.pop().remove()
