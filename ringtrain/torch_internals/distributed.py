"""torch.distributed's process-group internals: what ringtrain reads of a group (c10d).

- `process_groups`, `sequence_number`: naming a rank that hangs (ringtrain.launch.hang);
- `flatten_dense_tensors`, `unflatten_dense_tensors`: broadcasting in a few flat chunks
  (ringtrain.ddp.init_sync; public fallbacks);
- `default_store`: the store of a process group torch started (ringtrain.runtime,
  ringtrain.checkpoint);
- `group_timeout`: communication lanes with their group's timeout (ringtrain.ddp.lanes).

Each section says which names its feature needs and what it does without them
(`features.py`: how a name is looked up, a feature switched off).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ringtrain.torch_internals.features import Feature, lookup

# ---- naming a rank that hangs (ringtrain.launch.hang) -----------------------------------------

_HANG = Feature(
    "naming a rank that hangs outside a collective the others wait in (ringtrain.launch.hang)",
    "the watchdog cannot name a rank stuck in its own code while the others wait in a "
    "collective (they wait for the backend's timeout); dead and silent ranks are still named")
_world = lookup("torch.distributed.distributed_c10d._world", _HANG)
lookup("torch.distributed.distributed_c10d._world.pg_map", _HANG)
lookup("torch.distributed.ProcessGroup._get_sequence_number_for_group", _HANG)


def process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process belongs to (a snapshot: safe from another thread).

    None where this torch cannot say: every rank's count is then 0 and the hang check quiet.
    """
    return list(dict(_world.pg_map)) if _HANG.on else []


def sequence_number(group: torch.distributed.ProcessGroup) -> int:
    """How many collectives this rank has issued on `group` (counted when issued, not done)."""
    _HANG.require()
    return int(group._get_sequence_number_for_group())



# ---- broadcasting tensors in a few flat chunks (ringtrain.ddp.init_sync) ------------------------

_COALESCED = Feature("broadcasting parameters and buffers in a few flat chunks "
                     "(ringtrain.ddp.init_sync.broadcast_coalesced)", None)
_flatten = lookup("torch._utils._flatten_dense_tensors", _COALESCED)
_unflatten = lookup("torch._utils._unflatten_dense_tensors", _COALESCED)


def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding `tensors` back to back (without torch's helper: a public cat)."""
    if _flatten is not None:
        return _flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_dense_tensors(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped as the tensors in `like` (without torch's helper: split + view)."""
    if _unflatten is not None:
        return _unflatten(flat, like)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like,
                                                strict=True)]


# ---- the store of a process group torch started (ringtrain.runtime, ringtrain.checkpoint) ------

_STORE = Feature(
    "the default process group's store (ringtrain.runtime, ringtrain.checkpoint.snapshot)",
    "ringtrain cannot use a process group that torch.distributed.init_process_group started "
    "(call ringtrain.init_distributed() instead), nor find a SnapshotManager's store on it "
    "(pass store=)")
_get_default_store = lookup("torch.distributed.distributed_c10d._get_default_store", _STORE)


def default_store() -> torch.distributed.Store:
    """The store the default process group was made with (it must be initialised)."""
    _STORE.require()
    return _get_default_store()


# ---- communication lanes with their group's timeout (ringtrain.ddp.lanes) -----------------------

_LANES = Feature("giving communication lanes their group's timeout (ringtrain.ddp.lanes)",
                 "communication lanes (comm_lanes > 1) get torch's default collective timeout, "
                 "not their group's")
lookup("torch.distributed.ProcessGroup._get_backend", _LANES)
lookup("torch._C._distributed_c10d.Backend.Options._timeout", _LANES)


def group_timeout(group: torch.distributed.ProcessGroup) -> timedelta | None:
    """The collective timeout `group` was made with, or None where its CPU backend does not say.

    None when the group has no CPU backend, or its backend keeps no options (a custom one):
    which backend a group has is a runtime fact, not torch's version. None too where this
    torch cannot say (torch's default timeout then applies).
    """
    if not _LANES.on:
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors on this group
        return None
    options = getattr(backend, "options", None)
    return None if options is None else options._timeout



#: This module's features, in order (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_HANG, _COALESCED, _STORE, _LANES]
