"""A host copy's walk of the state, kept from one save to the next (`host_copy.py`).

    plan = CopyPlan.record(walked, ...)     # the full walk: what it did, per tensor
    state, used, pending, devices, queued = plan.replay(new_state, ...)  # the next save's, or Stale

Why: the step that takes an asynchronous snapshot pays for the walk of its state in Python
(~700 tensors of a 14-layer GPT and its AdamW state: a storage key, a deferral decision and a
host view each; 15-22 ms of the step on an H200 in session 18, where the host is the step's
bottleneck). From save to save the state has the same structure over the same storages:
parameters and moments are the same live tensors, changed in place. `state_dict()` returns new
detached tensor objects at every call, so `id()` says nothing; what the walk's result depends on
is each tensor's `signature` (its type, layout, device, dtype, address, offset, shape, strides
and its storage's size), in the walk's order, and which storages are deferred and staged. When
all of those are what the recording walk saw, the walk would make the same decisions and hand
out the same host views (`kept_views.HostViews` keeps them already), so the replay hands them
out at once, and only fetches the sources of the copies queued now. Anything else (a tensor
replaced, resized or reshaped, a key added, storages shared differently, another set deferred
or staged) raises `Stale` and the caller walks in full, recording a new plan: the full walk
stays the reference (`HostCopy(planned=False)` never replays), and tests compare the two.

A plan is kept only from a walk whose every tensor got its host view there: not from a save
whose deferred buffers `finish()` allocates (the first on the CPU and on a staged device) nor
from one with rare kinds of tensors (copied afresh each time). It holds our host buffers and
views, never a source's storage (the live parameters are not kept alive by a plan).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["CopyPlan", "Stale", "rebuild", "signature"]

_Key = tuple[Any, ...]  # a storage: (device, address, bytes), as host_copy keys it


class Stale(Exception):
    """The state is not the plan's (its tensors or its structure differ): walk it in full."""


def signature(t: torch.Tensor) -> tuple:
    """What the host copy's decisions for `t` depend on. The storage's address is the tensor's
    less its offset in the dtype's bytes: `data_ptr()` with the offset and dtype stand for it."""
    return (type(t), t.layout, t.device, t.dtype, t.data_ptr(), t.storage_offset(), t.shape,
            t.stride(), t.untyped_storage().nbytes())


def rebuild(obj: Any, tensor: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """`obj` with containers copied and each tensor replaced by `tensor(t)`, in a fixed order.

    A container met twice (optimizer param_groups sharing one `betas` tuple) is copied once, as
    deepcopy's memo does: pickle then writes a reference to the first, as it does for the
    original, and the file is byte for byte a synchronous save's. Other objects than tensors,
    numpy arrays and containers are kept by reference (see `HostCopy`'s warning).
    """
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if not isinstance(obj, dict | list | tuple):
        return obj.copy() if isinstance(obj, np.ndarray) else obj
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same type and attributes (a state_dict's `_metadata`)
        for k, v in obj.items():
            out[k] = rebuild(v, tensor, memo)
    elif type(obj) is list:
        out = [rebuild(v, tensor, memo) for v in obj]
    elif type(obj) is tuple:
        out = tuple(rebuild(v, tensor, memo) for v in obj)
    else:
        out = obj
    memo[id(obj)] = out
    return out


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` covers its storage, every byte once: copying it copies the storage."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


class CopyPlan:
    """One full walk's decisions, replayed while the state is the same (see the module).

    Args:
        later_keys: the deferred storages' keys (`HostCopy.copy`'s `later`) the walk had.
        staged: the devices staged at that walk.
        signatures, views: per tensor in the walk's order, its `signature` and the host tensor
            the walk handed out for it.
        now: the copies queued in the step, in their order: (the position of the tensor whose
            storage is the source, the (to, from) devices' group, the host buffer, and whether
            that tensor covers its storage: then it is copied into its view as it is).
        deferred: the deferred storages the state reached, in order: (key, the position of its
            first tensor, host buffer, whether that tensor covers it, staged, and where it does
            on a staged device (the staging buffer, a view of it shaped as the tensor)).
        used: the walk's buffers by key (`HostCopy`'s, kept for the next save).
        devices: the devices whose queued copies the step's events wait for.
        groups: the (to, from) groups of the queued copies, in the walk's order.
    """

    def __init__(self, later_keys: set[_Key], staged: set[torch.device], signatures: list[tuple],
                 views: list[torch.Tensor], now: list[tuple[int, tuple, Any, bool]],
                 deferred: list[tuple], used: dict[_Key, Any],
                 devices: set[torch.device], groups: list[tuple]):
        self.later_keys, self.staged = later_keys, staged
        self.signatures, self.views = signatures, views
        self.now, self.deferred, self.used = now, deferred, used
        self.devices, self.groups = devices, groups
        self.bytes: tuple[int, int] | None = None  # (copied, deferred): `HostCopy.copy` sets it

    @classmethod
    def record(cls, walked: list[tuple | None], later_keys: Any, staged: set[torch.device],
               pending: dict[_Key, Any], used: dict[_Key, Any], devices: set[torch.device],
               groups: list[tuple]) -> CopyPlan | None:
        """The plan of a walk that `walked` (per tensor: the source, the host view handed out,
        for the first tensor of a storage copied now its (group, host buffer), and its
        storage's key; None for a tensor that got no view of a kept buffer), or None if any
        tensor got none. `pending`: the walk's deferred storages (`host_copy._Deferred`)."""
        if any(w is None for w in walked):
            return None
        first: dict[_Key, int] = {}
        for i, w in enumerate(walked):
            first.setdefault(w[3], i)
        now = [(i, w[2][0], w[2][1], _whole(w[0])) for i, w in enumerate(walked)
               if w[2] is not None]
        deferred = []
        for key, d in pending.items():
            t = walked[first[key]][0]
            staging_view = None
            if d.staging is not None and _whole(t):  # the step's copy into it, as tensors
                staging_view = (d.staging, torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    d.staging, 0, t.size(), t.stride()))
            deferred.append((key, first[key], d.host, _whole(t), d.staging is not None,
                             staging_view))
        return cls(set(later_keys), set(staged), [signature(w[0]) for w in walked],
                   [w[1] for w in walked], now, deferred, dict(used), set(devices), list(groups))

    def fits(self, later_keys: Any, staged: set[torch.device]) -> bool:
        """Whether this save defers and stages what the recording walk did."""
        return staged == self.staged and later_keys == self.later_keys

    def replay(self, obj: Any, sources: dict[_Key, Any], staging_buffer: Callable,
               deferred: Callable) -> tuple:
        """What `HostCopy._walk_all` returns for `obj` (its state, buffers used, deferred
        storages, devices, copies queued), from the plan; raises `Stale` at the first tensor
        that is not the plan's. `sources`: the deferred storages by key; `staging_buffer`:
        `DeviceStaging.buffer`; `deferred`: `host_copy._Deferred`.

        A copy whose source tensor covers its storage copies that tensor into the view the
        plan holds (the same bytes): no byte tensor made over the source (~5 us each, in the
        step or on the writer's thread, where it holds the GIL the step needs)."""
        signatures, views, seen = self.signatures, self.views, []
        n = len(signatures)

        def tensor(t: torch.Tensor) -> torch.Tensor:
            i = len(seen)
            try:
                same = i < n and signature(t) == signatures[i]
            except (RuntimeError, NotImplementedError):  # no strides or storage (sparse, ...)
                same = False
            if not same:
                raise Stale(f"tensor {i} of the state differs from the plan's")
            seen.append(t)
            return views[i]

        state = rebuild(obj, tensor, {})
        if len(seen) != n:
            raise Stale(f"{len(seen)} tensors in the state, {n} in the plan")
        queued: dict[tuple, list] = {g: [] for g in self.groups}
        for i, group, host, whole in self.now:
            queued[group].append((views[i], seen[i]) if whole else
                                 (host, seen[i].untyped_storage()))
        pending = {}
        for key, i, host, whole, staged, staging_view in self.deferred:
            source, staging = sources[key], None
            if staged:
                staging = staging_buffer(key, source)
                kept = staging_view is not None and staging_view[0] is staging  # not remade
                queued[(key[0], key[0])].append((staging_view[1], seen[i]) if kept else
                                                (staging, source))
            pending[key] = deferred(source, host, staging, (views[i], seen[i]) if whole else None)
        return state, dict(self.used), pending, set(self.devices), queued
