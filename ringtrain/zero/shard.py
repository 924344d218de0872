"""The sharding plan: which elements of which parameter each rank owns (pure index math).

A *unit* is a group of parameters that is gathered, reduced and freed together (a transformer
block, or what is left of the model: embeddings and head). Its parameters are laid out back to
back in one flat fp32 vector, padded with zeros to a multiple of `world_size`; rank r owns the
contiguous slice `[r * shard_numel, (r + 1) * shard_numel)` of every unit (ZeRO, Rajbhandari et
al., SC 2020; the flat-parameter layout of torch's FSDP1). Equal shards are what a ring
reduce-scatter and all-gather need, and AdamW is element-wise, so updating a slice of the flat
vector is the same arithmetic as updating the whole parameters.

Nothing here touches a process group: `plan_units` takes the shapes and `world_size` and is
unit-tested without processes (`.venv/bin/pytest -q tests/test_zero.py -k plan`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its unit's flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the flat vector
    numel: int


@dataclass(frozen=True)
class UnitPlan:
    """One unit: its parameters' slots, the padded flat size and the per-rank shard size."""

    index: int
    slots: tuple[ParamSlot, ...]
    numel: int  # real elements
    padded: int  # numel rounded up to a multiple of world_size
    shard_numel: int  # padded // world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard in the flat vector."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """(slot index, start inside the parameter, end) of each parameter part rank owns."""
        lo, hi = self.shard_range(rank)
        parts = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                parts.append((i, a - s.offset, b - s.offset))
        return parts


def plan_units(units: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
               world_size: int) -> list[UnitPlan]:
    """Lay out each unit's parameters (name, shape) flat and cut it into `world_size` shards.

    Args:
        units: per unit, its parameters' (qualified name, shape), in registration order.
        world_size: ranks sharing every unit.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: it must be a positive integer")
    seen: set[str] = set()
    plans = []
    for u, params in enumerate(units):
        slots, offset = [], 0
        for name, shape in params:
            if name in seen:
                raise ValueError(f"parameter {name!r} is in two units; give each parameter to "
                                 "exactly one unit (tied weights must share a unit)")
            seen.add(name)
            n = math.prod(shape)
            slots.append(ParamSlot(name, tuple(shape), offset, n))
            offset += n
        padded = -(-offset // world_size) * world_size
        plans.append(UnitPlan(u, tuple(slots), offset, padded, padded // world_size))
    return plans


def expected_bytes(numel: int, world_size: int, stage: int, *, state_bytes: int = 8,
                   elem: int = 4) -> dict[str, float]:
    """Bytes per rank held between steps, by the ZeRO paper's count, for `numel` parameters.

    Stage 1: params 4, grads 4, optimizer state 8/N bytes per parameter (fp32 AdamW: two
    moments); stage 2: grads 4/N too; stage 3: params 4/N too. Excludes padding (< world_size
    elements per unit) and the working set (stage 3: the gathered unit being computed).
    """
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: ZeRO has stages {STAGES}; use 1 (optimizer state "
                         "sharded), 2 (+ gradients) or 3 (+ parameters)")
    n = world_size
    return {"params": numel * elem / (n if stage == 3 else 1),
            "grads": numel * elem / (n if stage >= 2 else 1),
            "optimizer": numel * state_bytes / n}
