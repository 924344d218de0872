"""Tensor parallelism (Megatron-LM) with sequence parallelism: every rank holds part of each
matrix, on an explicit process group.

Read in this order:
- `naive.py`: the naive reference: t ranks simulated in one process with lists (MLP, its
  sequence-parallel form, the vocab-parallel loss), the algebra without any communication code.
- `comm.py`: the region boundaries (copy / reduce / gather / split, and their sequence-parallel
  all-gather / reduce-scatter versions) as autograd Functions, over the collectives they call
  (on gloo the reduce-scatter is `ringtrain.rings`' send/recv ring).
- `layers.py`: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`, each
  built from the plain module it replaces (this rank's slice of the same weights).
- `attention.py`: `HeadParallelAttention`, n_head / t heads per rank.
- `rng.py`: dropout's masks: alike where the ranks hold an activation whole, a stream of each
  rank's own where they hold parts (`sharded_rng`, `ShardedDropout`).
- `loss.py`: `vocab_parallel_cross_entropy`, the loss of vocab-sharded logits, never gathered.
- `plan.py`: `parallelize(model, plan, group)` and the styles a plan names (torch's
  `parallelize_module` convention); `gpt_plan()` for ringtrain's GPT.
- `volumes.py`: the bytes a step communicates and the activations it saves per rank, from the
  textbook formulas (pure; `ringtrain plan` and `ringtrain explain` use them).
- the layout of ranks (dp x pp x tp, tp innermost) and its groups: `ringtrain.grid`, one for
  every strategy (`--strategy tp`, and `--strategy pipeline --tp`).
- `state.py`: a parameter's slice for a tp rank and the whole tensor from the slices, and a
  model's and its optimizer's by name (pure): how `--strategy tp` (`ringtrain/strategies/tp.py`)
  converts its snapshots, under ZeRO too.

The reference is the model itself in one process: tests/test_tensor_parallel.py checks logits,
loss, every gradient and 20 AdamW steps against it, and the counted bytes against `volumes`.

Why plain collectives and autograd Functions, not torch's DTensor: DTensor's
`parallelize_module` runs on gloo and CPU with torch 2.13 (checked: ColwiseParallel,
RowwiseParallel, SequenceParallel on a 2-rank gloo mesh), but (1) its parameters become
DTensors, which ringtrain's checkpoints, ZeRO's flat shards and the DDP reducer do not take;
(2) what crosses ranks is decided by sharding propagation inside the dispatcher, where the
bytes per step must be read off the code and counted exactly; (3) ringtrain's fused q, k, v
projection needs a per-block split that a plain Colwise shard of the fused matrix gets wrong
(on 2 ranks it would hand rank 0 all of q and half of k); (4) the DeviceMesh API is still
moving between the torch versions users run (2.11 to 2.13). Here each boundary is one
visible collective. The cost: no automatic redistribution; a module the plan does not name
runs replicated, on whatever its input is.

May import: torch, `ringtrain.collectives`, `ringtrain.rings` (gloo's reduce-scatter).
Guide: docs/tensor_parallel.md.
"""

from ringtrain.tensor_parallel import naive
from ringtrain.tensor_parallel.attention import HeadParallelAttention
from ringtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_rows,
)
from ringtrain.tensor_parallel.loss import vocab_parallel_cross_entropy
from ringtrain.tensor_parallel.plan import (
    ColwiseParallel,
    HeadParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    SplitSequence,
    VocabParallel,
    gpt_plan,
    parallelize,
)
from ringtrain.tensor_parallel.volumes import expected_bytes, ring_bytes_per_rank

__all__ = [
    "ColumnParallelLinear", "ColwiseParallel", "HeadParallel", "HeadParallelAttention",
    "ParallelStyle", "RowParallelLinear", "RowwiseParallel", "SequenceParallel", "SplitSequence",
    "VocabParallel", "VocabParallelEmbedding", "expected_bytes", "gpt_plan", "parallelize",
    "naive", "ring_bytes_per_rank", "shard_rows", "vocab_parallel_cross_entropy",
]
