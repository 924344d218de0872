"""When each ZeRO unit is gathered, freed and reduced: the hooks and what they call.

`ZeroDataParallel` (`sharded.py`) builds the units and offers the wrapper's surface (forward,
no_sync, clipping, state dicts); this module holds the schedule its hooks drive during forward
and backward, as a base class of the wrapper (`UnitHooks`): gathering a unit before its forward
(stage 3: prefetching the next, freeing it after), gathering it again before its backward,
counting each unit's gradients and launching its reduce-scatter in one fixed order on every
rank, and the end-of-backward callback that reduces what never fired and waits for every
unit. The hooks torch calls are module-level functions holding a weak reference to the
wrapper, so a hook left on a module never keeps a dropped wrapper alive.

Kept apart from the wrapper because this is the part whose order must be the same on every
rank (a collective launched out of order deadlocks), read best on its own. The fields it
uses are set in `ZeroDataParallel.__init__` and listed on `UnitHooks`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ringtrain.ddp.eager import call_eagerly
from ringtrain.torch_internals import backward_tls_free, queue_backward_callback
from ringtrain.zero.units import FlatUnit

_REDUCES_IN_FLIGHT = 3  # one per default communication lane


class UnitHooks:
    """The forward/backward schedule of `ZeroDataParallel`'s units (a base class of it)."""

    # Set by ZeroDataParallel.__init__.
    units: list[FlatUnit]
    stage: int
    world_size: int
    _root: FlatUnit | None
    _order: list[FlatUnit]  # launch order: the order backward makes them
    _next: int  # the next unit of `_order` to launch
    _queued: bool  # the end-of-backward callback is queued
    _sync_this_backward: bool
    _held_gathered: int
    _in_forward: bool
    peak_gathered_bytes: int

    def _register_hooks(self, module: nn.Module, unit_modules: list[nn.Module],
                        kept: list[tuple[int, list[tuple[str, nn.Parameter]]]]
                        ) -> list[RemovableHandle]:
        """Put the hooks on the parameters (gradient ready) and unit modules (forward)."""
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, me, k))
                   for k, u in enumerate(self.units) for p in u.params]
        if self._root is not None:
            # forward() gathers the root itself; this hook starts the first block's gather and
            # catches the plain module called while its parameters are freed (stage 3).
            handles.append(module.register_forward_pre_hook(_eager_hook(_pre_forward, me, 0)))
        for k, (i, _) in enumerate(kept):
            if i > 0:
                m = unit_modules[i - 1]
                handles.append(m.register_forward_pre_hook(_eager_hook(_pre_forward, me, k)))
                if self.stage == 3:
                    handles.append(m.register_forward_hook(_eager_hook(_post_forward, me, k)))
        return handles

    # ---- gathering and freeing units ----------------------------------------------------------

    def _gather(self, unit: FlatUnit, *, wait: bool = True) -> None:
        """Make `unit` present; `wait=False` only starts it (a prefetch, ahead of its use)."""
        if self.stage == 3 and not unit.gathered:
            self._held_gathered += unit.nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held_gathered)
        unit.start_gather()  # stages 1, 2: the gather started after the last step, if any
        if wait:
            unit.wait_gather()

    def _prefetch(self, k: int) -> None:
        if self.stage == 3 and 0 <= k < len(self.units) and self.units[k] is not self._root:
            self._gather(self.units[k], wait=False)

    def _wait_all_gathers(self) -> None:
        if self.stage < 3:
            for unit in self.units:
                unit.gather()

    def _free(self, unit: FlatUnit) -> None:
        if self.stage == 3 and unit.gathered:
            unit.free()
            self._held_gathered -= unit.nbytes

    # ---- backward -----------------------------------------------------------------------------

    def _grad_ready(self, k: int) -> None:
        if not self._queued:
            self._queued = True
            queue_backward_callback(functools.partial(_on_backward_end, weakref.ref(self)))
        unit = self.units[k]
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._complete(unit)

    def _complete(self, unit: FlatUnit) -> None:
        unit.complete = True
        if self._sync_this_backward and unit.reduced:
            # Every rank raises here alike (same program), so no rank is left in a collective.
            raise RuntimeError(
                "a second synced backward before optimizer.zero_grad(): ZeRO reduces each synced "
                "backward into this rank's shard and cannot add another to it. Run all but the "
                "last backward of a step under model.no_sync(), and zero_grad() after step()")
        if self._sync_this_backward:
            # Launch strictly in `_order`: every rank must issue the same collectives in the
            # same order on each lane, whatever order its gradients arrived in.
            while self._next < len(self._order) and self._order[self._next].complete:
                self._order[self._next].launch_reduce(1.0 / self.world_size)
                self._next += 1
                # Each reduce in flight holds its unit's whole flat gradient: finish the oldest
                # beyond one per lane, or all of them would be alive at the end of backward (4
                # bytes per parameter, as much as DDP's gradients). Same point on every rank.
                if self.stage > 1 and self._next > _REDUCES_IN_FLIGHT:
                    self._order[self._next - 1 - _REDUCES_IN_FLIGHT].finish_reduce()
        if unit is not self._root:
            self._free(unit)  # its gradients are in: backward will not read its weights again

    def _finish_backward(self) -> None:
        try:
            for unit in self._order:
                if not unit.complete:  # parameters that got no gradient count as zero
                    self._complete(unit)
            if self._sync_this_backward:
                for unit in self._order:
                    unit.finish_reduce()
        finally:
            for unit in self.units:
                unit.ready, unit.complete = 0, False
                self._free(unit)
            self._next, self._queued = 0, False


# ---- the hooks torch calls ----------------------------------------------------------------------


def _on_grad(ref: weakref.ref, unit: int, _param: torch.Tensor) -> None:
    me = ref()
    if me is not None:
        with backward_tls_free():  # it may launch a collective (see ringtrain.ddp.reducer)
            me._grad_ready(unit)


def _on_backward_end(ref: weakref.ref) -> None:
    me = ref()
    if me is not None:
        with backward_tls_free():
            me._finish_backward()


def _eager_hook(hook, ref: weakref.ref, k: int):
    # gathers, frees and a weakref'd backward hook: run as written under torch.compile
    return functools.partial(call_eagerly, hook, ref, k)


def _pre_forward(ref: weakref.ref, k: int, module: nn.Module, _args: Any) -> None:
    me = ref()
    if me is None:
        return
    if me._in_forward:
        me._gather(me.units[k])
        me._prefetch(k + 1)  # stage 3: the next unit travels while this one computes
    elif me.units[k].gathered:
        me.units[k].wait_gather()  # stages 1, 2: the gather started after the last step
    else:
        # The plain module called directly: gathering here would be a collective the other
        # ranks are not making, and the parameters have no data.
        raise RuntimeError(f"{type(module).__name__} was called outside ZeroDataParallel's forward "
                           "while its parameters are sharded (stage 3): call the wrapper, or "
                           "full_state_dict(keep_gathered=True) on every rank first")


def _post_forward(ref: weakref.ref, k: int, _module: nn.Module, _args: Any, out: Any) -> None:
    me = ref()
    if me is None or not me._in_forward:
        return
    unit = me.units[k]
    me._free(unit)
    if torch.is_grad_enabled():
        # Just before this unit's backward its output's gradient is complete: gather again then.
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(_pre_backward, ref, k))


def _pre_backward(ref: weakref.ref, k: int, _grad: torch.Tensor) -> None:
    me = ref()
    if me is not None:
        with backward_tls_free():
            me._gather(me.units[k])
            me._prefetch(k - 1)  # backward runs the units in reverse
