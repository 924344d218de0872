"""ZeRO state per rank, in a form any number of ranks can load (resharding N -> M).

A rank's state is its slice of every unit's flat vector (`shard.py`): the parameters, and each
per-element optimizer tensor (AdamW's `exp_avg`, `exp_avg_sq`) laid out the same way, so the
state of N ranks put end to end is the full flat vector of each unit, padding last. Scalars
(AdamW's `step`) are the same for every part and saved once. Loading on M ranks is index math:
rank m needs elements `[m * S_M, (m + 1) * S_M)` of each unit, which saved rank r holds where
that range meets `[r * S_N, (r + 1) * S_N)` (`sources`); the same code loads the same world
size (one source: itself), so there is one path and it is bit-identical.

    parts = {r: torch.load(f"rank{r}.pt")["zero"] for r in needed}   # ZeroDataParallel does this
    full = consolidate(list_of_every_rank_state)    # the unsharded params and moments, per unit

Pure functions (no process group): `.venv/bin/pytest -q tests/test_zero.py -k reshard`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

FORMAT = 2  # 1: the optimizer's own state_dict (same world size only)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank of a unit of `numel` elements cut into `world_size` shards."""
    return -(-numel // world_size)


def sources(numels: Sequence[int], saved_world_size: int, world_size: int, rank: int) -> list[int]:
    """The saved ranks whose parts rank `rank` of `world_size` needs, for units of `numels`."""
    need: set[int] = set()
    for n in numels:
        mine, saved = shard_numel(n, world_size), shard_numel(n, saved_world_size)
        lo, hi = rank * mine, min((rank + 1) * mine, n)  # padding needs nobody
        if lo < hi:
            need.update(range(lo // saved, (hi - 1) // saved + 1))
    return sorted(need)


def assemble(pieces: Mapping[int, torch.Tensor], saved_shard: int, lo: int, hi: int,
             numel: int) -> torch.Tensor:
    """Elements `[lo, hi)` of a unit's flat vector from saved rank r's shard `pieces[r]`
    (each `saved_shard` long); elements at or past `numel` are padding (zeros)."""
    out = torch.zeros(hi - lo, dtype=next(iter(pieces.values())).dtype)
    for r, t in pieces.items():
        a, b = max(lo, r * saved_shard), min(hi, (r + 1) * saved_shard, numel)
        if a < b:
            out[a - lo:b - lo] = t[a - r * saved_shard:b - r * saved_shard]
    return out


def check_parts(parts: Mapping[int, Mapping[str, Any]], names: Sequence[Sequence[str]]) -> int:
    """The saved world size of `parts` (saved rank -> state), after checking they fit `names`
    (each unit's parameter names, in layout order); raises ValueError naming the difference."""
    if not parts:
        raise ValueError("no ZeRO parts to load")
    saved_ws = {int(p["world_size"]) for p in parts.values()}
    if len(saved_ws) != 1:
        raise ValueError(f"ZeRO parts from different world sizes {sorted(saved_ws)}: one "
                         "snapshot's parts only")
    for r, p in parts.items():
        if p.get("format") != FORMAT:
            raise ValueError(f"ZeRO part of rank {r} has format {p.get('format')!r}, this version "
                             f"reads {FORMAT}: resume it with the ringtrain that wrote it")
        saved = [list(u) for u in p["names"]]
        if saved != [list(u) for u in names]:
            diff = next((i for i, (a, b) in enumerate(zip(saved, names, strict=False))
                         if list(a) != list(b)), min(len(saved), len(names)))
            raise ValueError(f"ZeRO part of rank {r} was saved from another model: unit {diff} "
                             f"differs ({len(saved)} units saved, {len(names)} here); resume "
                             "with the model options it was saved with")
    return saved_ws.pop()


def unit_state(parts: Mapping[int, Mapping[str, Any]], k: int, numel: int, lo: int,
               hi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unit k's parameters and per-element optimizer tensors over `[lo, hi)`, from `parts`."""
    some = next(iter(parts.values()))
    saved = shard_numel(numel, int(some["world_size"]))
    params = assemble({r: p["shards"][k] for r, p in parts.items()}, saved, lo, hi, numel)
    # A rank that owned nothing of any parameter has no optimizer state: zeros, like padding.
    keys = sorted({key for p in parts.values() for key in p["moments"][k]})
    moments = {key: assemble({r: p["moments"][k][key] for r, p in parts.items()
                              if key in p["moments"][k]},
                             saved, lo, hi, numel) for key in keys}
    return params, moments


def scalars(parts: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The optimizer's per-parameter scalars (AdamW's `step`): equal on every rank that has any."""
    return next((dict(p["scalars"]) for p in parts.values() if p["scalars"]), {})


def consolidate(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Every saved rank's state -> the full (unsharded, unpadded) flat vectors of each unit:
    {"names", "params": [tensor], "moments": [{key: tensor}], "scalars"}."""
    parts = {int(s["rank"]): s for s in states}
    some = next(iter(parts.values()))
    check_parts(parts, some["names"])
    if sorted(parts) != list(range(int(some["world_size"]))):
        raise ValueError(f"consolidate needs every rank's part: got ranks {sorted(parts)} of "
                         f"world_size={some['world_size']}")
    params, moments = [], []
    for k, n in enumerate(some["numels"]):
        p, m = unit_state(parts, k, n, 0, n)
        params.append(p)
        moments.append(m)
    return {"names": some["names"], "params": params, "moments": moments, "scalars": scalars(parts)}
