"""The options strategies share (`--tp`, `--sequence-parallel`: tp and pipeline; `--zero-stage`:
zero and tp), each one field defined once
(their help is the same wherever they appear; only the default is each strategy's).

    ringtrain train --strategy tp --tp 2 --nproc-per-node 2
    ringtrain train --pp 2 --tp 2 --sequence-parallel --nproc-per-node 4
"""

from __future__ import annotations

from typing import Any

from ringtrain.config import int_at_least, option


def tp_option(default: int) -> Any:
    """`--tp`: the tensor-parallel degree (`ringtrain.grid`'s innermost axis)."""
    return option(default, "tensor-parallel degree: ranks that split every matrix (consecutive "
                  "ranks, one host; with --pp, each stage's); must divide the world size, "
                  "n_head and the vocabulary (default: 1 with --strategy pipeline, 2 with "
                  "--strategy tp)", type=int_at_least(1))


def sequence_parallel_option() -> Any:
    """`--sequence-parallel`: Megatron's sequence parallelism on the tp group."""
    return option(False, "sequence parallelism: the norms and the residual stream on "
                  "block_size / tp tokens per rank, all-gather and reduce-scatter instead of "
                  "all-reduce (block_size must be divisible by --tp)")


def zero_stage_option(default: int, choices: tuple[int, ...]) -> Any:
    """`--zero-stage`: what ZeRO shards over the data-parallel ranks (`ringtrain.zero`); 0 (none)
    is a choice only where the strategy runs without ZeRO too."""
    return option(default, "ZeRO: what is sharded over the data-parallel ranks: 1 optimizer "
                  "state, 2 + gradients, 3 + parameters (--strategy zero: 2 by default; "
                  "--strategy tp: 0, no ZeRO, by default, 1-3 shard each rank's slices over its "
                  "dp group)", type=int, choices=choices,
                  shown="2 with --strategy zero, 0 with --strategy tp")
