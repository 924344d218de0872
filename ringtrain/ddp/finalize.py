"""How a round of the bucketed all-reduce ends: at the end of backward, or called outside it.

`Reducer` (`reducer.py`) plans the buckets and launches each one from the gradient hooks while
backward runs; this module holds the other half, as a base class of it (`Finalize`): the
callback queued on the autograd engine (`_finalize`) stages what never got a hook call (no_sync
gradients, unused parameters), waits for every bucket (or its comm hook's future), agrees with
the other ranks on unused parameters (`unused_params.py`) and writes the averages back, then
resets the round. `sync_gradients()` and `defer()`/`flush()` end a round the same way from
outside backward (all gradients present, or staged earlier), for benchmarks and tests.

Kept apart from the launch because it is where a round's errors surface on every rank alike
and where the works' lifetime is handled (see `_reset`); it reads the round's state that
`Reducer.__init__` sets up (listed on `Finalize`) and stages and launches through the
reducer's `_mark_ready` and `_launch`. Tests: `.venv/bin/pytest -q tests/test_ddp.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp import buckets
from ringtrain.ddp.buckets import Bucket, GradBucket, hook_result
from ringtrain.ddp.static_graph import StaticGraphCheck
from ringtrain.ddp.unused_params import (
    STEP_GUARD,
    StatusBuffer,
    UnusedParametersError,
    check_unused,
    fill_status,
)
from ringtrain.torch_internals import current_autograd_node
from ringtrain.trace import Tracer


def _profiled(name: str, when: bool):
    # torch's DDP records its unused-parameter search as "torch.distributed.ddp.reducer::
    # search_unused_parameters"; profiler users (and torch's own tests) match the suffix. A few
    # microseconds per backward, so only where torch has it (find_unused_parameters=True).
    return torch.autograd.profiler.record_function(name) if when else contextlib.nullcontext()


class Finalize:
    """The end of a round of `Reducer`'s buckets (a base class of it)."""

    # Set by Reducer.__init__ (and Reducer._build for the buckets).
    params: list[nn.Parameter]
    names: list[str]
    tracer: Tracer
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    find_unused_parameters: bool
    static_graph: StaticGraphCheck | None
    gradient_as_bucket_view: bool
    comm_hook: Callable[[Any, GradBucket], torch.futures.Future] | None
    expect_sync: bool
    buckets: list[Bucket]
    _observed: list[int] | None
    _next_order: list[int] | None
    _ready: bytearray
    _unused: list[int]
    _status: StatusBuffer
    _retired: list
    _accumulated: bytearray
    _next: int
    _hold: bool
    _queued: bool
    _defer: bool
    _deferred: bool
    staging_s: float
    last_error: str | None
    unfinished_error: str | None
    _note_round: Callable[[list[int]], None]
    _note_local_use: Callable[[torch.Tensor], None]
    _wait_post_backward_futures: Callable[[], None]

    # ---- when backward ends ----------------------------------------------------------------

    def _finalize(self) -> None:
        if current_autograd_node() is not None and not all(self._ready):
            # This backward is nested in another one's node: a reentrant activation checkpoint
            # (torch.utils.checkpoint(use_reentrant=True)) around the layers whose gradients
            # came first. The outer backward is not done; let its next gradient queue the
            # callback again, on the outer backward this time.
            self._queued = False
            return
        if self._observed is not None:
            seen = set(self._observed)
            self._next_order = self._observed + [i for i in reversed(range(len(self.params)))
                                                 if i not in seen]
            self._observed = None
        if self._defer:
            self._defer, self._deferred = False, True  # flush() finishes this round
            return
        try:
            with torch.no_grad(), self.tracer.span("finish gradient sync"):
                self._stage_rest()
                self._complete()
                self._wait_post_backward_futures()  # torch_members.py: a buffer hook's
            self._note_round(self._unused)  # framework_members.py: can_set_static_graph
        except Exception as e:
            self.last_error = str(e)  # what torch's DDP logging reports as "error"
            raise
        finally:
            self._reset()

    # ---- an unused parameter with find_unused_parameters=False -------------------------------

    def _hold_error(self, message: str) -> None:
        # Not raised here but at the next forward (torch's point, see unused_params.py) and
        # at an optimizer step before it (ringtrain's addition, StepGuard): every rank holds
        # the same message's verdict, so every rank raises at the same point.
        self.unfinished_error = message
        STEP_GUARD.hold(self)

    def raise_unfinished(self) -> None:
        """Raise the unused-parameter error a synced round left pending, if any (torch's
        `ensure_prior_reduction_finished`: a synced forward, `prepare_for_backward` and, in
        ringtrain, `optimizer.step()` call it). It stays pending, as in torch."""
        if self.unfinished_error is not None:
            self.last_error = self.unfinished_error  # what torch's DDP logging reports
            raise UnusedParametersError(self.unfinished_error)

    def _stage_rest(self) -> None:
        """Stage what never got a hook call this round: no_sync gradients and unused ones."""
        unused = self._unused
        for i, p in enumerate(self.params):
            if self._ready[i]:
                continue
            if self._accumulated[i] and p.grad is not None:
                self._mark_ready(i, p.grad, used=True)  # its gradient came in a no_sync step
            else:
                unused.append(i)  # before staging: the last bucket's launch reads it
                # Stage zeros (or a stale .grad, as torch does) so that this rank still issues
                # every bucket's collective: the other ranks are waiting on them.
                self._mark_ready(i, p.grad, used=False)

    def _complete(self) -> None:
        """Wait for every bucket, agree on unused parameters, write the averages back.

        An unused parameter with find_unused_parameters=False is not raised here: the error is
        held for the next forward (`raise_unfinished`).
        """
        unused = self._unused
        n = len(self.params)
        status_bucket = next((b for b in self.buckets if b.tail_sent), None)
        mask_work = None
        if self.world_size > 1 and status_bucket is None and self.comm_hook is None:
            # No bucket carried the status: one small all-reduce, in flight with the buckets.
            mask, mask_work = self._status.launch(self._unused, self.rank, self.process_group)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            elif bucket.fut is not None:
                result = hook_result(bucket.fut.wait(), bucket.buffer, self.comm_hook, bucket.index)
                if not buckets.same_tensor(result, bucket.buffer):
                    bucket.buffer.copy_(result)  # e.g. an fp16 result into fp32 gradients
            if bucket.scale_after is not None:
                bucket.buffer.mul_(bucket.scale_after)
        # Every rank learns which parameters were unused where: an error is then raised on all
        # ranks together (no rank left waiting in the next collective), and a parameter unused
        # on every rank keeps its .grad, as in torch.
        if self.world_size == 1:
            status = fill_status(torch.zeros(n + 1), unused, n, 0)
        elif status_bucket is not None:
            status = status_bucket.tail
        else:
            if mask_work is None:
                # After a comm hook's buckets are done, not before: a hook may still issue
                # collectives from its callbacks (PowerSGD does) and ours must not race them for
                # a place in the group's order.
                mask, mask_work = self._status.launch(self._unused, self.rank, self.process_group)
            mask_work.wait()
            status = mask
        self._note_local_use(status)  # torch_members.py: _get_local_used_map
        if self.static_graph is not None:  # raises on every rank alike (static_graph.py)
            self.static_graph.check(status, unused)
        with _profiled("ringtrain.ddp.reducer::search_unused_parameters",
                       self.find_unused_parameters):
            globally_unused, error = check_unused(status, self.rank, self.names, unused,
                                                  self.find_unused_parameters)
        # Written back even when the round has an error to report: every bucket did complete,
        # and the averages (a missing gradient counted as zero, as with find_unused_parameters=
        # True) keep the replicas equal even if something updates them outside torch.optim
        # (torch leaves .grad partly reduced here, different on each rank).
        buckets.write_back(self.buckets, self.params, globally_unused,
                           as_view=self.gradient_as_bucket_view)
        if error is not None:
            self._hold_error(error)

    def _reset(self) -> None:
        # Keep this round's works (and so the tensors they hold) until the next synced forward:
        # gloo's worker thread drops its own reference a moment after a work completes, and if
        # that is the last one, a tensor whose Python object died meanwhile (a gradient set to
        # None by zero_grad) needs the GIL on that thread, which aborts a process already in
        # interpreter shutdown ("terminate called without an active exception").
        self._retired = [b.work or b.fut for b in self.buckets
                         if b.work is not None or b.fut is not None]
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
            bucket.buffer, bucket.work, bucket.fut, bucket.in_place = None, None, None, False
            bucket.scale_after, bucket.tail_sent = None, False
            bucket.gradients = []
        self._ready = bytearray(len(self.params))
        self._unused = []
        self._accumulated = bytearray(len(self.params))
        self._next = 0
        self._queued = False
        self.expect_sync = False

    # ---- outside backward ------------------------------------------------------------------

    def sync_gradients(self) -> None:
        """Average the current `.grad` of every parameter now, outside backward.

        The same buckets, copies, hooks and checks as a synced backward, in the same order; for
        gradients that did not come from a DDP forward (and to time the sync path by itself,
        as `benchmarks/ddp_vs_torch.py` does). Call it on every rank.
        """
        if self._queued:
            raise RuntimeError("sync_gradients() was called during a synced backward; "
                               "call it after")

        try:
            with torch.no_grad():
                self._hold = True
                for i, p in enumerate(self.params):
                    if p.grad is not None:
                        self._mark_ready(i, p.grad, used=True)
                self._stage_rest()
                self._hold = False
                # Every gradient is already here, so unlike in backward nothing forces the
                # production order: small buckets go first, their fixed cost hidden behind the
                # transfer of the large ones. With a comm hook, index order (hooks such as
                # PowerSGD count iterations on the last bucket).
                order = list(self.buckets)
                if self.comm_hook is None:
                    order.sort(key=lambda b: b.buffer.numel())
                for bucket in order:
                    self._launch(bucket)
                self._next = len(self.buckets)
                self._complete()
        finally:
            self._hold = False
            self._reset()

    def defer(self) -> None:
        """Make the next synced backward stage its gradients but send nothing; `flush()` sends.

        Staging is the hooks' part (averaging each gradient while it is hot, copying small ones
        into their bucket); `staging_s` records its time. `flush()` then launches every bucket in
        order, waits, checks unused parameters and writes back: the communication alone, with
        no compute running (`benchmarks/ddp_vs_torch.py` times the two to measure the sync path
        as training runs it). Call both on every rank.
        """
        if self._queued or self._deferred:
            raise RuntimeError("defer() must come before the forward of the backward to defer, "
                               "and after the flush() of the previous one")
        self._defer, self.staging_s = True, 0.0

    def flush(self) -> None:
        """Send and finish the deferred backward's buckets (see `defer()`)."""
        if not self._deferred:
            raise RuntimeError("flush() without a deferred backward: call defer(), then the "
                               "forward and backward, then flush()")
        try:
            with torch.no_grad():
                self._hold = True  # stage what never fired first: the last bucket's status
                self._stage_rest()  # is final only then
                self._hold = False
                while self._next < len(self.buckets):
                    self._launch(self.buckets[self._next])
                    self._next += 1
                self._complete()
        finally:
            self._hold, self._deferred = False, False
            self._reset()
