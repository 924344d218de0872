"""A `ZeroDataParallel`'s state per rank: written in the flat layout of `reshard.py`, read back
from the parts of any number of saved ranks.

Used by `ZeroDataParallel.shard_state_dict` / `load_shard_state_dicts` (`sharded.py`); the
optimizer's parts and where they sit in each unit's shard come from `ZeroOptimizer.locations`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringtrain.zero.optimizer import ZeroOptimizer
from ringtrain.zero.reshard import FORMAT, check_parts, scalars, sources, unit_state
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
    moments: list[dict[str, torch.Tensor]] = [{} for _ in units]
    scal: dict[str, Any] = {}
    for part, k, start, n in optimizer.locations:
        for key, v in opt.state.get(part, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == part.shape:
                flat = moments[k].get(key)
                if flat is None:
                    flat = moments[k][key] = v.new_zeros(units[k].plan.shard_numel)
                flat[start:start + n] = v.detach().reshape(-1)
            elif key not in scal:
                scal[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return {"format": FORMAT, "stage": stage, "world_size": world_size, "rank": rank,
            "numels": [u.plan.numel for u in units], "names": unit_names(units),
            "shards": [u.shard.detach().clone() for u in units], "moments": moments,
            "scalars": scal,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt.param_groups]}


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
