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
                   bias: bool = True, dtype_bytes: int = 4, recompute_gather: bool = False,
                   embedding: bool = True, head: bool = True,
                   backwards: int = 1) -> dict[str, int]:
    """Bytes per training step (forward + backward) by collective, for `gpt_plan`.

    Args:
        n_layer, n_embd: the GPT's depth and width (h).
        batch, seq: the micro-batch's b and s.
        sequence_parallel: whether the plan used sequence parallelism.
        bias: whether the GPT has biases (LayerNorm and Linear).
        dtype_bytes: bytes per activation element (4 for fp32).
        recompute_gather: the column layers all-gather their input again in backward (one
            more all-gather of a per column layer: 2 per transformer layer, 1 for lm_head).
        embedding, head: whether the layers come with the embedding and with the head (ln_f,
            lm_head, the loss); a pipeline stage has its own (the first one, the last one).
        backwards: backward passes per step (a pipeline's micro-batches). Under SP the
            replicated parameters' gradients are summed after each one
            (`comm.sum_grad_over_group`'s hook), where Megatron-LM sums them once per step;
            the activations' bytes are the same either way.
    """
    a = batch * seq * n_embd * dtype_bytes
    e, h = int(embedding), int(head)
    loss = 3 * batch * seq * 4 * h  # max, then (target logit, sum of exp), in fp32
    if not sequence_parallel:
        return {"all_reduce": a * (4 * n_layer + e + h) + loss, "all_gather": 0,
                "reduce_scatter": 0}
    per_layer_params = (2 * 2 + 2) * n_embd if bias else 2 * n_embd  # ln_1, ln_2, 2 row biases
    ln_f = (2 if bias else 1) * n_embd * h
    grads = (n_layer * per_layer_params + ln_f) * 4 * backwards
    again = a * (2 * n_layer + h) if recompute_gather else 0
    return {"all_reduce": a * e + loss + grads,
            "all_gather": a * (4 * n_layer + h + e) + again,  # layers, lm_head fwd, embedding bwd
            "reduce_scatter": a * (4 * n_layer + h)}  # layers, lm_head backward


def ring_bytes_per_rank(op: str, nbytes: int, tp: int) -> float:
    """What a ring implementation of `op` on a tensor of `nbytes` sends from each rank."""
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if op not in factor:
        raise ValueError(f"ring_bytes_per_rank: op={op!r} is not one of {sorted(factor)}")
    return factor[op] * (tp - 1) / tp * nbytes


def activation_bytes(*, n_layer: int, n_embd: int, batch: int, seq: int, vocab_size: int, tp: int,
                     sequence_parallel: bool = False, recompute_gather: bool = False,
                     dtype_bytes: int = 4) -> float:
    """Bytes autograd saves for backward per rank in one forward and loss of `gpt_plan`'s GPT.

    With a = b*s*h*dtype_bytes, per layer: the attention's q, k, v (3a), its output and c_proj's
    input (2a), the MLP's GELU input and c_proj's input (8a) are split over the t ranks (13a/t);
    the two norms' inputs and the two column layers' inputs (4a) are whole on every rank under
    tp alone. Sequence parallelism splits the norms' inputs (2a/t), and `recompute_gather` the
    column inputs (2a/t). The head adds ln_f's and lm_head's inputs (as a norm and a column
    layer) and the loss's softmax, b*s*V/t floats. Left out: the norms' mean and rstd, the
    attention's logsumexp (b*s floats each), token ids. The measured table of
    docs/tensor_parallel.md is this to 0.5% (tp 1/2/4, with and without SP).
    """
    if tp < 1:
        raise ValueError(f"activation_bytes: tp={tp}; it must be >= 1")
    a = batch * seq * n_embd * dtype_bytes
    norms = (2 * n_layer + 1) * a  # ln_1, ln_2 of every layer, ln_f: their inputs
    columns = (2 * n_layer + 1) * a  # c_attn, mlp.0 of every layer, lm_head: their inputs
    split = 13 * n_layer * a + batch * seq * vocab_size * 4
    return (split / tp + (norms / tp if sequence_parallel else norms)
            + (columns / tp if recompute_gather else columns))


def whole_params(*, n_layer: int, n_embd: int, block_size: int, bias: bool = True) -> int:
    """Parameters of `gpt_plan`'s GPT that every tp rank holds whole: the norms, the position
    embedding and the row-parallel layers' biases (attn.c_proj, mlp.2); the rest is split."""
    norm = 2 * n_embd if bias else n_embd
    row_biases = 2 * n_embd if bias else 0
    return n_layer * (2 * norm + row_biases) + norm + block_size * n_embd
