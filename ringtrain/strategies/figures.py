"""What a strategy costs, in numbers: the figures `ringtrain explain` words.

    figures = DDPConfig(grad_compress="bf16").figures(Workload(world_size=4, params=10**6,
                                                                step_batch=16))
    figures.held_bytes, figures.sent_bytes      # per rank: between steps; per optimizer step

Each strategy's `Config.figures(workload)` fills a `Figures` (or its own subclass, which adds
what only that strategy has: a pipeline's bubble, a parameter server's staleness bound) from
its options and the run's `Workload`. The words around them are `ringtrain explain`'s
(`ringtrain/cli/explain_words.py`), so a test checks the numbers, not the sentences.

The count is the textbook one, not a measurement: parameters and gradients in fp32, AdamW's two
fp32 moments, collectives by ring (what gloo runs; Patarasuk & Yuan 2009: an all-reduce sends
2(N-1)/N of the buffer, a reduce-scatter or an all-gather (N-1)/N). Padding, temporary buffers,
activations kept for backward and the allocator's slack are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4  # parameters, gradients and activations travel in fp32 (under bf16 autocast too)
ADAMW_BYTES = 2 * FP32_BYTES  # AdamW's two moments (exp_avg, exp_avg_sq) per parameter


def all_reduce_share(world_size: int) -> float:
    """Bytes a rank sends in a ring all-reduce, per byte of the buffer: 2(N-1)/N."""
    return 2 * (world_size - 1) / world_size


def gather_share(world_size: int) -> float:
    """Bytes a rank sends in a ring reduce-scatter or all-gather, per byte of the buffer."""
    return (world_size - 1) / world_size


@dataclass(frozen=True)
class Workload:
    """What a strategy's figures depend on besides its own options.

    Args:
        world_size: ranks in the job.
        params: the model's parameters (elements).
        step_batch: samples per data rank per optimizer step (--batch-size x --grad-accum).
        grad_accum: micro-batches per optimizer step (--grad-accum).
        sample_numel: activation elements one sample carries across a layer boundary
            (block_size x n_embd for the GPT); 0 where unknown.
        n_layer: transformer layers (the GPT's n_layer); 0 where unknown.
        block_size, vocab_size: the GPT's (tensor parallelism's activations); 0 where unknown.
        whole_params: parameters tensor parallelism keeps whole on every rank (norms, position
            embedding, row-parallel biases: `tensor_parallel.volumes.whole_params`).
    """

    world_size: int
    params: int
    step_batch: int
    grad_accum: int = 1
    sample_numel: int = 0
    n_layer: int = 0
    block_size: int = 0
    vocab_size: int = 0
    whole_params: int = 0

    @property
    def model_bytes(self) -> int:
        """The model's parameters (or gradients) in fp32."""
        return self.params * FP32_BYTES

    def replica(self) -> dict[str, float]:
        """What a full replica trained with fp32 AdamW holds: 4 + 4 + 8 bytes per parameter."""
        return {"params_bytes": float(self.model_bytes), "grads_bytes": float(self.model_bytes),
                "optimizer_bytes": float(self.params * ADAMW_BYTES)}


@dataclass(frozen=True, kw_only=True)
class Figures:
    """A strategy's figures: per rank, between optimizer steps and per optimizer step.

    Where ranks differ (pipeline stages, parameter-server workers and servers), the common
    fields are those of a rank that reads data, and the subclass adds the others.
    """

    data_ranks: int  # ranks that read data (the sampler's num_replicas)
    params_bytes: float  # parameters held between steps, copies included
    grads_bytes: float
    optimizer_bytes: float  # optimizer state (AdamW's moments, an outer optimizer's)
    # Sent per optimizer step, on average over steps (the busiest rank where they differ);
    # None: not estimated before the run (counted during it, e.g. PowerSGD's factors).
    sent_bytes: float | None

    @property
    def held_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes
