"""Head-parallel causal self-attention: each rank computes n_head / t whole heads.

Heads are independent until the output projection, so the fused q, k, v projection is
column-parallel (split per block: rank r keeps the q, k and v rows of its heads) and the output
projection row-parallel: one all-reduce (or reduce-scatter under sequence parallelism) forward
and one backward per attention, and the (B, nh, T, T) scores stay local (Megatron-LM, sec. 3).

Built from ringtrain's `CausalSelfAttention` by its attribute names (`c_attn`, `c_proj`,
`n_head`, `dropout`, `resid_drop`): a model with the same layout parallelises the same way,
and this package never imports the models.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ringtrain.tensor_parallel import comm
from ringtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ringtrain.tensor_parallel.rng import ShardedDropout, sharded_rng


class HeadParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads.

    Args:
        c_attn: column-parallel fused q, k, v projection (rows [q_r; k_r; v_r]).
        c_proj: row-parallel output projection.
        n_local_heads: heads on this rank (n_head / t).
        dropout: attention-weight dropout probability.
        resid_drop: the dropout after the output projection.
    """

    def __init__(self, c_attn: ColumnParallelLinear, c_proj: RowParallelLinear,
                 n_local_heads: int, dropout: float, resid_drop: nn.Module):
        super().__init__()
        self.c_attn, self.c_proj, self.resid_drop = c_attn, c_proj, resid_drop
        self.n_local_heads, self.dropout = n_local_heads, dropout

    @classmethod
    def from_attention(cls, attn: nn.Module, group, *, sequence_parallel: bool = False,
                       recompute_gather: bool = False) -> HeadParallelAttention:
        """This rank's heads of `attn` (a `CausalSelfAttention`)."""
        t = comm.group_size(group)
        if attn.n_head % t:
            raise ValueError(f"HeadParallelAttention: n_head={attn.n_head} is not divisible by "
                             f"tp={t}; use a tp degree that divides the number of heads")
        c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group, chunks=3,
                                                  sequence_parallel=sequence_parallel,
                                                  recompute_gather=recompute_gather)
        c_proj = RowParallelLinear.from_linear(attn.c_proj, group,
                                               sequence_parallel=sequence_parallel)
        # Under SP the projection's output is this rank's tokens: a mask of its own for them.
        resid_drop = ShardedDropout.from_dropout(attn.resid_drop, group) if sequence_parallel \
            else attn.resid_drop
        return cls(c_attn, c_proj, attn.n_head // t, attn.dropout, resid_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 * C/t): under SP x was (B, T/t, C) and is gathered
        B, T, three_local = qkv.shape
        local = three_local // 3
        q, k, v = qkv.split(local, dim=2)
        hs = local // self.n_local_heads
        # (B, T, C/t) -> (B, nh/t, T, hs)
        q, k, v = (t.view(B, T, self.n_local_heads, hs).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        with sharded_rng(self.c_attn.group, x.device) if p > 0 else nullcontext():
            # this rank's heads: masks of their own (the shared stream would drop head h here
            # as head h + nh/t on the next rank)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        # y: (B, nh/t, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, local)
        return self.resid_drop(self.c_proj(y))  # (B, T, C), or (B, T/t, C) under SP
