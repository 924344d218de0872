"""Data parallelism: every rank holds the whole model; gradients are averaged by all-reduce.

Read in this order:
- `naive.py`: the reference. After backward, one all-reduce per parameter; 55 lines.
- `distributed.py`: `DistributedDataParallel`, the drop-in for torch's (same arguments,
  `no_sync`, comm hooks, unused parameters, pickling); it hands every gradient to the reducer.
- `ctor_args.py`: each constructor argument of torch's (2.11 to 2.15) checked and given its
  meaning, or refused by name; `init_sync.py`: the check and broadcast at construction;
  `ignored.py`: parameters and buffers kept out of DDP (torch's
  `_set_params_and_buffers_to_ignore_for_model`); `mixed_precision.py` and `delayed.py`: the
  `mixed_precision=` and `delay_all_reduce_named_params=` arguments.
- `reducer.py`: the bucketed all-reduce, launched from autograd hooks while backward still runs.
- `finalize.py`: how a round ends (the reducer's base class): the end-of-backward callback waits
  for every bucket, agrees on unused parameters, writes the averages back; `sync_gradients`,
  `defer`/`flush` outside backward.
- `buckets.py`: which gradients travel together (pure planning, unit-tested without processes),
  and which bucket carries the unused-parameter status.
- `join.py`: uneven inputs, `join()` with torch's `Join`: what a rank that ran out of batches
  issues to match the others; `uneven.py`: the reducer's part (a shadow backward, the divisor).
- `static_graph.py`: static_graph=True refuses a graph that changed after the first backward.
- `lanes.py`: extra gloo groups over the same ranks, so buckets travel side by side.
- `eager.py`: what torch.compile runs as written around the user's module (DDP's and ZeRO's
  bookkeeping), so `torch.compile(wrapper)` traces the module only.
- `comm_hooks.py`: replacements for a bucket's all-reduce (fp16/bf16 compression, ring all-reduce).
- `state_keys.py`: a wrapper's `load_state_dict` takes the plain model's keys too (no
  `module.`), DDP's and ZeRO's.
- `unused_params.py`: what a synced backward reports about parameters that got no gradient,
  and when: at the next forward, as torch's DDP, and in an optimizer step before it.
- `framework_members.py`: the private members of torch's DDP and reducer that Lightning and
  accelerate call (`_get_ddp_logging_data`, `reducer._rebuild_buckets`, ...), as mixins;
  `torch_members.py`: those only torch's own tests call (`_register_buffer_comm_hook`,
  `reducer._get_local_used_map`, ...).

May import: torch, `ringtrain.runtime`, `ringtrain.torch_internals`, `ringtrain.errors`,
`ringtrain.ranges`, `ringtrain.staging`, `ringtrain.trace`, `ringtrain.collectives`. Never the
trainer, strategies or launcher.
"""

from ringtrain.ddp.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
