"""Data parallelism: every rank holds the whole model; gradients are averaged by all-reduce.

Read in this order:
- `naive.py`: the reference. After backward, one all-reduce per parameter; 55 lines.
- `distributed.py`: `DistributedDataParallel`, the drop-in for torch's (same arguments,
  `no_sync`, comm hooks, unused parameters); it hands every gradient to the reducer.
- `reducer.py`: the bucketed all-reduce, launched from autograd hooks while backward still runs.
- `finalize.py`: how a round ends (the reducer's base class): the end-of-backward callback waits
  for every bucket, agrees on unused parameters, writes the averages back; `sync_gradients`,
  `defer`/`flush` outside backward.
- `buckets.py`: which gradients travel together (pure planning, unit-tested without processes),
  and which bucket carries the unused-parameter status.
- `broadcast.py`: rank `src`'s parameters or buffers to every rank, in a few flat broadcasts.
- `join.py`: uneven inputs, `join()` with torch's `Join`: what a rank that ran out of batches
  issues to match the others; `uneven.py`: the reducer's part (a shadow backward, the divisor).
- `static_graph.py`: static_graph=True refuses a graph that changed after the first backward.
- `lanes.py`: extra gloo groups over the same ranks, so buckets travel side by side.
- `comm_hooks.py`: replacements for a bucket's all-reduce (fp16/bf16 compression, ring all-reduce).
- `unused_params.py`: what a synced backward reports about parameters that got no gradient.

May import: torch, `ringtrain.runtime`, `ringtrain.torch_internals`, `ringtrain.errors`,
`ringtrain.ranges`, `ringtrain.staging`, `ringtrain.trace`, `ringtrain.collectives`. Never the
trainer, strategies or launcher.
"""

from ringtrain.ddp.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
