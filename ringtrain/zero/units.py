"""One unit's flat storage: full parameters, this rank's shard, gradients, gather and free.

The module's parameters become views into `full` (one flat fp32 vector per unit, the layout of
`shard.py`), so gathering a unit is one ring all-gather into `full` and freeing it is
`full.untyped_storage().resize_(0)`: every view, including the ones autograd saved for
backward, shares that one storage, and sees the data again once it is resized and refilled (the
trick of torch's FSDP1). Writes into `full` do not bump the parameters' version counters (a
parameter whose `.data` was set keeps its own), so autograd does not mistake a re-gather for an
in-place edit of a saved tensor.

Where each stage keeps what (per rank; P parameters of the unit, S = padded / N):
    stage 1  full (P, always)   grad_full (P, persistent; .grad are views)  shard = full[r]
    stage 2  full (P, always)   shard_grad (S; the flat gradient lives only during its reduce)
    stage 3  full (P, only while gathered)   shard (S, own storage)   shard_grad (S)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.rings import all_gather, reduce_scatter
from ringtrain.trace import COMM, NO_TRACE, Tracer
from ringtrain.zero.shard import UnitPlan


class FlatUnit:
    """The parameters of one unit, flattened and sharded over `group` (see the module docstring).

    Args:
        plan: the unit's layout (`shard.plan_units`).
        params: its parameters, in the plan's order; they become views into `full`.
        group: the ranks sharing it; rank r owns `plan.shard_range(r)`.
        lane: the group its collectives travel on (same ranks as `group`).
        stage: 1, 2 or 3.
    """

    # What `--trace-steps` records: the waits for this unit's ring collectives, which advance
    # inside `wait()` (`ringtrain.rings`), so the span is the time a step stood still for them.
    tracer: Tracer = NO_TRACE
    label = "unit"

    def __init__(self, plan: UnitPlan, params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                 lane: dist.ProcessGroup, stage: int):
        self.plan, self.params, self.lane, self.stage = plan, list(params), lane, stage
        self.rank, self.world_size = group.rank(), group.size()
        self.lo, self.hi = plan.shard_range(self.rank)
        p0 = self.params[0]
        self.full = torch.zeros(plan.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, slot in zip(self.params, plan.slots, strict=True):
                if p.dtype != p0.dtype or p.device != p0.device:
                    raise TypeError(f"parameter {slot.name!r} is {p.dtype} on {p.device}, "
                                    f"others in its unit are {p0.dtype} on {p0.device}: a unit "
                                    "is one flat tensor; cast the model to one dtype first "
                                    "(model.float())")
                self.full[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                p.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.nbytes = plan.padded * self.full.element_size()
        self.grad_full: torch.Tensor | None = None
        if stage == 3:
            self.shard = self.full[self.lo:self.hi].clone()
        else:
            self.shard = self.full[self.lo:self.hi]  # the optimizer updates `full` in place
        if stage == 1:
            self.grad_full = torch.zeros_like(self.full)
            self.shard_grad = self.grad_full[self.lo:self.hi]
        else:
            self.shard_grad = torch.zeros_like(self.shard)
        self.gathered = True
        self._gather_work = None
        if stage == 3:
            self.free()
        self.reduced = False  # shard_grad holds a reduced gradient not yet zeroed
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.complete = False
        self._work = None
        self._flat_grad: torch.Tensor | None = None

    # ---- parameters ---------------------------------------------------------------------------

    def pieces(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
        """(parameter, its owned part of the shard, that part's gradient) for each owned part."""
        out = []
        for slot_i, a, b in self.plan.owned(self.rank):
            slot = self.plan.slots[slot_i]
            s, e = slot.offset + a - self.lo, slot.offset + b - self.lo
            out.append((self.params[slot_i], self.shard[s:e], self.shard_grad[s:e]))
        return out

    def start_gather(self) -> None:
        """Start making the full parameters present (all ranks, same order); `wait_gather` ends it.

        Stage 3: from the shard into re-allocated storage. Stages 1 and 2: after the optimizer
        updated this rank's part of `full` in place, spread it (the other parts are stale until
        `wait_gather`).
        """
        if self.gathered:
            return
        if self.stage == 3:
            self.full.untyped_storage().resize_(self.nbytes)
            with torch.no_grad():
                self.full[self.lo:self.hi].copy_(self.shard)
        self._gather_work = all_gather(self.full, self.lane)
        self.gathered = True

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            with self.tracer.span("all-gather", COMM, unit=self.label):
                self._gather_work.wait()
            self._gather_work = None

    def gather(self) -> None:
        """Make the full parameters present now."""
        self.start_gather()
        self.wait_gather()

    def stale(self) -> None:
        """Stages 1 and 2: this rank's part changed; the others' parts must be gathered again."""
        self.gathered = False

    def free(self) -> None:
        """Drop the full parameters (stage 3); their views stay valid, with no data behind them."""
        if self.stage == 3 and self.gathered:
            self.wait_gather()  # never free storage a collective is still writing
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    # ---- gradients ----------------------------------------------------------------------------

    def launch_reduce(self, scale: float) -> None:
        """Average this unit's gradients over the group into `shard_grad` (asynchronously).

        Every `.grad` is scaled by `scale` (1 / N) as it is copied into the flat gradient: the
        order of operations of our DDP (divide, then sum), so 2 ranks give the same bits.
        """
        with torch.no_grad():
            if self.grad_full is not None:  # stage 1: .grad are (or become) views of grad_full
                flat = self.grad_full
                for p, slot in zip(self.params, self.plan.slots, strict=True):
                    view = flat[slot.offset:slot.offset + slot.numel]
                    if p.grad is None:
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad.reshape(-1))
                    p.grad = view.view(slot.shape)
                flat.mul_(scale)
            else:
                flat = self.shard_grad.new_empty(self.plan.padded)  # lives until the reduce ends
                for p, slot in zip(self.params, self.plan.slots, strict=True):
                    view = flat[slot.offset:slot.offset + slot.numel]
                    if p.grad is None:
                        view.zero_()
                    else:
                        torch.mul(p.grad.reshape(-1), scale, out=view)
                    p.grad = None  # stages 2 and 3 keep only the shard's gradient
                flat[self.plan.numel:].zero_()
            self._flat_grad = flat
            self._work = reduce_scatter(self.shard_grad, flat, self.lane)

    def finish_reduce(self) -> None:
        if self._work is not None:
            with self.tracer.span("reduce-scatter", COMM, unit=self.label):
                self._work.wait()
            self.reduced = True
        self._work, self._flat_grad = None, None

    def zero_grad(self) -> None:
        self.reduced = False
        for p in self.params:
            if self.grad_full is None:
                p.grad = None
        if self.grad_full is not None:
            self.grad_full.zero_()
        else:
            self.shard_grad.zero_()

    # ---- what it holds (counted from the tensors) ---------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes this unit holds now: parameters (full if present, own shard storage) and grads."""
        params = self.full.untyped_storage().nbytes()
        if self.stage == 3:
            params += self.shard.untyped_storage().nbytes()
        grads = sum(p.grad.untyped_storage().nbytes() for p in self.params
                    if p.grad is not None and self.grad_full is None)
        grads += (self.grad_full if self.grad_full is not None
                  else self.shard_grad).untyped_storage().nbytes()
        return {"params": params, "grads": grads}
