"""Bytes a tensor-parallel GPT step communicates, from the textbook formulas (pure).

Each collective is counted by the size of the whole tensor it works on (an all-reduce's tensor,
an all-gather's output, a reduce-scatter's input). With a = b * s * h activation bytes, per
transformer layer and step (Megatron-LM; Korthikanti et al. 2022, sec. 4.2):

    tensor parallelism     4 all-reduces of a: 2 forward (after attention and MLP), 2 backward
                           (into them)
    + sequence parallelism 4 all-gathers + 4 reduce-scatters of a instead: the same traffic,
                           since a ring all-reduce is a reduce-scatter then an all-gather

On the wire a ring moves 2(t-1)/t of an all-reduce's bytes per rank, (t-1)/t of an
all-gather's or a reduce-scatter's (`ring_bytes_per_rank`). Around the layers, ringtrain's GPT
plan adds: the vocab-parallel embedding's forward all-reduce (a); the lm_head's input, whose
gradient is all-reduced (a; under SP an all-gather forward, a reduce-scatter backward, and the
embedding's output split along the sequence costs an all-gather of a backward); the loss's two
all-reduces of b*s and 2*b*s floats; under SP, the sum over the group of the gradients of the
parameters replicated on each rank but used on its tokens only (norms, row-parallel biases).
"""

from __future__ import annotations


def expected_bytes(*, n_layer: int, n_embd: int, batch: int, seq: int, sequence_parallel: bool,
                   bias: bool = True, dtype_bytes: int = 4,
                   recompute_gather: bool = False) -> dict[str, int]:
    """Bytes per training step (forward + backward) by collective, for `gpt_plan`.

    Args:
        n_layer, n_embd: the GPT's depth and width (h).
        batch, seq: the micro-batch's b and s.
        sequence_parallel: whether the plan used sequence parallelism.
        bias: whether the GPT has biases (LayerNorm and Linear).
        dtype_bytes: bytes per activation element (4 for fp32).
        recompute_gather: the column layers all-gather their input again in backward (one
            more all-gather of a per column layer: 2 per transformer layer, 1 for lm_head).
    """
    a = batch * seq * n_embd * dtype_bytes
    loss = 3 * batch * seq * 4  # max, then (target logit, sum of exp), in fp32
    if not sequence_parallel:
        return {"all_reduce": a * (4 * n_layer + 2) + loss, "all_gather": 0, "reduce_scatter": 0}
    per_layer_params = (2 * 2 + 2) * n_embd if bias else 2 * n_embd  # ln_1, ln_2, 2 row biases
    ln_f = (2 if bias else 1) * n_embd
    grads = (n_layer * per_layer_params + ln_f) * 4
    again = a * (2 * n_layer + 1) if recompute_gather else 0
    return {"all_reduce": a + loss + grads,
            "all_gather": a * (4 * n_layer + 2) + again,  # layers, lm_head fwd, embedding bwd
            "reduce_scatter": a * (4 * n_layer + 1)}  # layers, lm_head backward


def ring_bytes_per_rank(op: str, nbytes: int, tp: int) -> float:
    """What a ring implementation of `op` on a tensor of `nbytes` sends from each rank."""
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if op not in factor:
        raise ValueError(f"ring_bytes_per_rank: op={op!r} is not one of {sorted(factor)}")
    return factor[op] * (tp - 1) / tp * nbytes
