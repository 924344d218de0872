"""Sharded data parallelism (ZeRO stages 1, 2, 3): each rank keeps 1/N of what DDP replicates.

Read in this order:
- `shard.py`: the plan: units of parameters laid out flat, padded, cut into N equal shards;
  the bytes each stage holds (pure, unit-tested without processes).
- `units.py`: one unit's storage: full parameters as views of one flat tensor, this rank's
  shard, gradients; gather/free (stage 3), reduce (launched from backward hooks), over the
  send/recv rings of `ringtrain.rings` (faster than gloo's own on CPU; the measurement is in
  its docstring; the naive all-reduce references beside them).
- `optimizer.py`: `ZeroOptimizer`, the user's optimizer rebuilt over this rank's parts.
- `sharded.py`: `ZeroDataParallel`, the wrapper for a plain module and an optimizer factory:
  the units built, forward, no_sync, clipping, state dicts, counted bytes.
- `hooks.py`: `UnitHooks`, the wrapper's base class: the forward/backward hooks and the schedule
  they drive (gather, prefetch, free; reduce-scatters launched in one order on every rank; the
  end-of-backward callback).
- `reshard.py`, `state.py`: each rank's state in a flat layout that any number of ranks can
  load (a snapshot of N ranks resumed on M), and the index math behind it.

May import: torch, `ringtrain.runtime`, `ringtrain.torch_internals`, `ringtrain.errors`,
`ringtrain.ranges`, `ringtrain.ddp` (its communication lanes), `ringtrain.staging`,
`ringtrain.trace`, `ringtrain.collectives`, `ringtrain.rings`. Guide: docs/zero.md.
"""

from ringtrain.zero import reshard
from ringtrain.zero.optimizer import ZeroOptimizer
from ringtrain.zero.shard import expected_bytes, plan_units
from ringtrain.zero.sharded import ZeroDataParallel, default_units

__all__ = ["ZeroDataParallel", "ZeroOptimizer", "default_units", "expected_bytes", "plan_units",
           "reshard"]
