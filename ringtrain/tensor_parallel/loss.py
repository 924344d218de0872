"""Cross-entropy over vocabulary-sharded logits that never gathers them (Megatron-LM's
_VocabParallelCrossEntropy).

Rank r holds logits[..., r*V/t:(r+1)*V/t]. The loss of a token needs only three numbers per
token from across the group, so two all-reduces of (N,) replace an all-gather of (N, V):

    m = max over the vocab        all-reduce MAX of each rank's local max (for stability)
    z = target's logit - m        0 on the ranks that do not hold the target; summed
    s = sum of exp(logit - m)     summed, in the same all-reduce as z
    loss = log(s) - z

Backward is local: softmax(logits) - onehot(target) on this rank's columns.
"""

from __future__ import annotations

import torch

from ringtrain.tensor_parallel import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        # logits (N, V/t) float, targets (N,) global ids
        n_local = logits.size(-1)
        vocab_start = comm.group_rank(group) * n_local
        logits_max = comm.all_reduce(logits.max(dim=-1).values, group, op=comm.dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)  # (N, V/t)
        local = targets - vocab_start
        elsewhere = (local < 0) | (local >= n_local)  # includes ignore_index (-1)
        local = local.masked_fill(elsewhere, 0)
        rows = torch.arange(shifted.size(0), device=shifted.device)
        target_logit = shifted[rows, local].masked_fill(elsewhere, 0.0)  # (N,)
        exp = shifted.exp()
        both = comm.all_reduce(torch.stack([target_logit, exp.sum(dim=-1)]), group)  # (2, N)
        target_logit, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, elsewhere)
        return sum_exp.log() - target_logit  # (N,)

    @staticmethod
    def backward(ctx, g):
        softmax, local, elsewhere = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local] -= (~elsewhere).to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 ignore_index: int = -1) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits (..., V/t) against global target ids (...).

    Equals `F.cross_entropy(full_logits.reshape(-1, V).float(), targets.reshape(-1),
    ignore_index=ignore_index)` (ringtrain's `loss_fn`); targets equal to `ignore_index` are
    left out of the mean. Every rank gets the same loss.

    Args:
        logits: this rank's slice of the vocabulary, e.g. a column-parallel lm_head's output.
        targets: token ids over the whole vocabulary, the same on every rank.
        group: the tensor-parallel process group.
        ignore_index: a target id that contributes no loss (must lie outside [0, V)).
    """
    flat = logits.reshape(-1, logits.size(-1)).float()
    flat_targets = targets.reshape(-1)
    losses = _VocabParallelCrossEntropy.apply(flat, flat_targets, group)  # (N,)
    keep = (flat_targets != ignore_index).to(losses.dtype)
    return (losses * keep).sum() / keep.sum()
