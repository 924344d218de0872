"""A `ZeroDataParallel`'s state per rank: written in the flat layout of `reshard.py`, read back
from the parts of any number of saved ranks.

Used by `ZeroDataParallel.shard_state_dict` / `load_shard_state_dicts` (`sharded.py`); the
optimizer's parts and where they sit in each unit's shard come from `ZeroOptimizer.locations`.
`to_named` and `from_named` convert every rank's parts to and from whole tensors by parameter
name (the layout-free form of `ringtrain.strategies.portable`, for a resume by another strategy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringtrain.zero.optimizer import ZeroOptimizer
from ringtrain.zero.reshard import (
    FORMAT,
    check_parts,
    consolidate,
    scalars,
    sources,
    unit_state,
)
from ringtrain.zero.units import FlatUnit


def unit_names(units: Sequence[FlatUnit]) -> list[list[str]]:
    return [[s.name for s in u.plan.slots] for u in units]


def shard_state(units: Sequence[FlatUnit], optimizer: ZeroOptimizer, *, stage: int, world_size: int,
                rank: int) -> dict[str, Any]:
    """This rank's shard of every unit and its optimizer state laid out like the shard.

    An optimizer tensor shaped like its part is per element (AdamW's moments): it goes into a
    flat vector per unit and key, zeros where this rank holds padding. Anything else (AdamW's
    `step`) is a scalar, the same for every part: kept once.
    """
    opt = optimizer.optimizer
    moments = flat_moments(units, optimizer)
    scal: dict[str, Any] = {}
    for part, _k, _start, _n in optimizer.locations:
        for key, v in opt.state.get(part, {}).items():
            if not _per_element(v, part) and key not in scal:
                scal[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return {"format": FORMAT, "stage": stage, "world_size": world_size, "rank": rank,
            "numels": [u.plan.numel for u in units], "names": unit_names(units),
            "shapes": [[list(s.shape) for s in u.plan.slots] for u in units],
            "shards": [u.shard.detach() if own_storage(u.shard) else u.shard.detach().clone()
                       for u in units],
            "moments": moments,
            "scalars": scal,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt.param_groups]}


def own_storage(t: torch.Tensor) -> bool:
    """`t` is the whole of its storage (stage 3's shard, a flat moment buffer): saved as is,
    `torch.save` writes exactly its bytes, as it would a clone's. A view of a larger storage
    (stages 1/2's shard in `full`) would write all of `full`: that one is cloned."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _per_element(v: Any, part: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == part.shape


def flat_moments(units: Sequence[FlatUnit],
                 optimizer: ZeroOptimizer) -> list[dict[str, torch.Tensor]]:
    """Per unit and key, the flat vector of a per-element optimizer state (AdamW's moments),
    laid out like the unit's shard with zeros where this rank holds padding.

    The optimizer's per-part tensors become views into it, the first time only (`_adopt`), so
    later calls return the live flat buffers without a copy: a background snapshot copies them
    beside the next step (`ZeroStrategy.updated_state`) and their bytes are a clone's.
    """
    opt = optimizer.optimizer
    moments: list[dict[str, torch.Tensor]] = [{} for _ in units]
    for part, k, start, n in optimizer.locations:
        for key, v in opt.state.get(part, {}).items():
            if not _per_element(v, part):
                continue
            flat = moments[k].get(key)
            if flat is None:
                base = torch.empty(0, dtype=v.dtype, device=v.device).set_(v.untyped_storage())
                if base.numel() == units[k].plan.shard_numel and own_storage(base):
                    flat = base  # adopted at an earlier call (or this unit's first part)
                else:
                    flat = v.new_zeros(units[k].plan.shard_numel)
                moments[k][key] = flat
            if not _is_view_at(v, flat, start, n):
                with torch.no_grad():
                    flat[start:start + n].copy_(v.detach().reshape(-1))
                # The optimizer changes its state in place (AdamW's foreach and fused paths
                # alike), so from now on it writes into `flat`.
                opt.state[part][key] = flat[start:start + n].view(part.shape)
    return moments


def _is_view_at(v: torch.Tensor, flat: torch.Tensor, start: int, n: int) -> bool:
    return (v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and v.storage_offset() == start and v.numel() == n and v.is_contiguous())


def load_parts(units: Sequence[FlatUnit], optimizer: ZeroOptimizer,
               parts: Mapping[int, Mapping[str, Any]], *, world_size: int, rank: int) -> None:
    """Fill this rank's shards and optimizer state from `parts` (saved rank -> `shard_state`),
    saved by any number of ranks; the caller frees gathered units first and spreads after."""
    saved_ws = check_parts(parts, unit_names(units))
    numels = [u.plan.numel for u in units]
    missing = sorted(set(sources(numels, saved_ws, world_size, rank)) - set(parts))
    if missing:
        raise ValueError(f"rank {rank} of world_size={world_size} needs the ZeRO parts of saved "
                         f"ranks {missing} (of world_size={saved_ws}); got {sorted(parts)}")
    saved_groups = next(iter(parts.values()))["param_groups"]
    opt = optimizer.optimizer
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the ZeRO parts have {len(saved_groups)} optimizer parameter groups, "
                         f"this optimizer {len(opt.param_groups)}: build it with the same "
                         "optimizer_fn")
    flat_moments = []
    with torch.no_grad():
        for k, u in enumerate(units):
            lo, hi = u.plan.shard_range(rank)
            params, moments = unit_state(parts, k, u.plan.numel, lo, hi)
            u.shard.copy_(params)
            flat_moments.append(moments)
    scal = scalars(parts)
    opt.state.clear()
    for part, k, start, n in optimizer.locations:
        if not flat_moments[k]:
            continue  # saved before the optimizer's first step: no state yet
        st: dict[str, Any] = {key: v.clone() if isinstance(v, torch.Tensor) else v
                              for key, v in scal.items()}
        for key, flat in flat_moments[k].items():
            st[key] = flat[start:start + n].to(part.device).view(part.shape).clone()
        opt.state[part] = st
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        group.update(saved)


def to_named(parts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, dict[str, Any]]]:
    """Every saved rank's `shard_state` -> (parameters, optimizer state) by parameter name, in
    each parameter's shape: the flat units put together and cut at the parameters' slots."""
    some = parts[0]
    if "shapes" not in some:
        raise ValueError("this ZeRO snapshot was written by a ringtrain that did not save the "
                         "parameters' shapes: resume it with --strategy zero")
    full = consolidate(parts)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for k, (names, shapes) in enumerate(zip(full["names"], some["shapes"], strict=True)):
        offset = 0
        for name, shape in zip(names, shapes, strict=True):
            n = math.prod(shape)
            model[name] = full["params"][k][offset:offset + n].view(shape).clone()
            if full["moments"][k]:  # none before the first step
                state[name] = {**{key: v.clone() if isinstance(v, torch.Tensor) else v
                                  for key, v in full["scalars"].items()},
                               **{key: flat[offset:offset + n].view(shape).clone()
                                  for key, flat in full["moments"][k].items()}}
            offset += n
    return model, state


def from_named(units: Sequence[FlatUnit], optimizer: ZeroOptimizer,
               model: Mapping[str, torch.Tensor], state: Mapping[str, Mapping[str, Any]], *,
               stage: int) -> dict[str, Any]:
    """The inverse of `to_named`: whole tensors by name -> one part, as if saved by a single
    rank, which `load_parts` re-slices for this rank (the same code as any resharding)."""
    shards: list[torch.Tensor] = []
    moments: list[dict[str, torch.Tensor]] = []
    scal: dict[str, Any] = {}
    for u in units:
        pieces, flat = [], {}
        for slot in u.plan.slots:
            t = model.get(slot.name)
            if t is None or tuple(t.shape) != slot.shape:
                raise ValueError(
                    f"parameter {slot.name!r} is "
                    f"{'missing' if t is None else tuple(t.shape)} in the snapshot, {slot.shape} "
                    "here: saved from another model; resume with the model options it was "
                    "saved with")
            pieces.append(t.detach().reshape(-1).cpu().to(u.shard.dtype))
            for key, v in state.get(slot.name, {}).items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == slot.shape and v.dim() >= 1:
                    out = flat.setdefault(key, torch.zeros(u.plan.numel, dtype=v.dtype))
                    out[slot.offset:slot.offset + slot.numel] = v.detach().reshape(-1).cpu()
                elif key not in scal:
                    scal[key] = v
                elif not _equal(scal[key], v):
                    raise ValueError(f"optimizer state {key!r} differs between parameters "
                                     f"({scal[key]} and {v} at {slot.name!r}): ZeRO keeps one "
                                     "per run")
        shards.append(torch.cat(pieces))
        moments.append(flat)
    return {"format": FORMAT, "stage": stage, "world_size": 1, "rank": 0,
            "numels": [u.plan.numel for u in units], "names": unit_names(units),
            "shapes": [[list(s.shape) for s in u.plan.slots] for u in units],
            "shards": shards, "moments": moments, "scalars": scal,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer.optimizer.param_groups]}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return a == b
