"""The naive reference: t tensor-parallel ranks simulated in one process, with lists for ranks.

Read this before `layers.py`. Each function holds every rank's shard in a Python list, and a
collective is a one-liner over the list (all-reduce: `sum`, all-gather: `cat`), so the algebra
of Megatron-LM's split is visible without processes, autograd Functions or groups; the tests
check it against the unsplit computation (tests/test_tensor_parallel.py, in process).

    python -c "import torch; from ringtrain.tensor_parallel import naive; \
x, w1, w2 = torch.randn(2, 8), torch.randn(32, 8), torch.randn(8, 32); \
print((naive.mlp(x, w1, w2, tp=4) - torch.nn.functional.gelu(x @ w1.T) @ w2.T).abs().max())"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tp: int) -> torch.Tensor:
    """gelu(x w1^T) w2^T on `tp` simulated ranks: w1 split by output rows (column-parallel),
    w2 by input columns (row-parallel); each rank's partial output, then one all-reduce."""
    w1_shards = w1.chunk(tp, dim=0)  # rank r: (4h/t, h)
    w2_shards = w2.chunk(tp, dim=1)  # rank r: (h, 4h/t)
    partial = [F.gelu(x @ a.T) @ b.T for a, b in zip(w1_shards, w2_shards, strict=True)]
    return sum(partial)  # the all-reduce: the (.., 4h/t) hidden never left its rank


def mlp_sequence_parallel(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                          tp: int) -> list[torch.Tensor]:
    """The same MLP entered and left along the sequence (dim 1 of (B, T, h)): rank r starts
    with tokens r*T/t.., all-gathers them, and keeps its tokens of the reduce-scattered sum."""
    tokens = list(x.chunk(tp, dim=1))  # what each rank holds between layers
    gathered = torch.cat(tokens, dim=1)  # all-gather: every rank sees all T tokens
    partial = [F.gelu(gathered @ a.T) @ b.T
               for a, b in zip(w1.chunk(tp, dim=0), w2.chunk(tp, dim=1), strict=True)]
    return list(sum(partial).chunk(tp, dim=1))  # reduce-scatter: summed, split by tokens


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: int) -> torch.Tensor:
    """Per-token cross-entropy of (N, V) logits held as `tp` vocabulary slices, exchanging
    three numbers per token instead of the logits."""
    shards = logits.chunk(tp, dim=-1)  # rank r: (N, V/t), ids r*V/t ..
    m = torch.stack([s.max(dim=-1).values for s in shards]).max(dim=0).values  # all-reduce MAX
    sum_exp = sum((s - m[:, None]).exp().sum(dim=-1) for s in shards)  # all-reduce SUM
    target_logit = torch.zeros_like(m)
    start = 0
    for s in shards:  # the rank that holds a token's target contributes its logit; others 0
        local = targets - start
        mine = (local >= 0) & (local < s.size(-1))
        picked = s.gather(-1, local.clamp(0, s.size(-1) - 1)[:, None])[:, 0] - m
        target_logit = target_logit + torch.where(mine, picked, torch.zeros_like(picked))
        start += s.size(-1)
    return sum_exp.log() - target_logit
