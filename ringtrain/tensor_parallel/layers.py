"""Column- and row-parallel linear layers and the vocabulary-parallel embedding.

Megatron-LM (Shoeybi et al. 2019): a Linear y = x A^T + b on t ranks.

    column-parallel  A split by output rows: rank r computes y[..., its columns]. Input
                     replicated (copy_to_region: backward all-reduces dL/dx), output sharded.
    row-parallel     A split by input columns: rank r computes a partial y from its slice of
                     x. Output all-reduced (reduce_from_region), bias added once after it.

An MLP is column then row: one all-reduce forward, one backward, and the (B, T, 4C) hidden
activation never leaves its rank. With sequence parallelism (Korthikanti et al. 2022) the input
arrives sharded along the sequence, the column layer all-gathers it and the row layer
reduce-scatters its output: the same bytes as the all-reduce (one all-reduce is a reduce-scatter
plus an all-gather), but what lies between blocks is 1/t on each rank.

Every layer is built from the plain module it replaces (`from_linear`, `from_embedding`), taking
this rank's slice of the very same weights, so a parallelised model starts equal to its
single-process original. Each sharded parameter carries `tp_shard_dim` (the dim it is split on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringtrain.tensor_parallel import comm


def shard_rows(weight: torch.Tensor, rank: int, world_size: int, chunks: int = 1) -> torch.Tensor:
    """Rank `rank`'s rows of `weight` (dim 0) when split `world_size` ways.

    `chunks` > 1: the rows are `chunks` stacked blocks (q, k, v of a fused projection), each
    split on its own, so a rank keeps matching slices of every block: [q_r; k_r; v_r].
    """
    rows = weight.size(0)
    if rows % (chunks * world_size):
        raise ValueError(
            f"tensor parallelism: {rows} rows ({chunks} block(s)) cannot be split evenly across "
            f"tp={world_size} ranks; choose a tp degree that divides {rows // chunks} (heads, "
            f"hidden width or vocabulary), or pad the vocabulary to a multiple of {world_size}")
    blocks = weight.reshape(chunks, rows // chunks, *weight.shape[1:])
    n = rows // chunks // world_size
    return blocks[:, rank * n:(rank + 1) * n].reshape(-1, *weight.shape[1:]).clone()


class _LinearOfGathered(torch.autograd.Function):
    """F.linear(all_gather(x along the sequence), weight, bias) that keeps only x's shard for
    backward and all-gathers it again there (Megatron-LM's sequence-parallel column layer): the
    saved input is 1/t of the gathered one, for one more all-gather of it per backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x, comm.SEQ_DIM, group), weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        full = comm.all_gather(x, comm.SEQ_DIM, ctx.group)  # (B, T, in): the recomputed gather
        grad_weight = g.reshape(-1, g.size(-1)).t() @ full.reshape(-1, full.size(-1))
        grad_bias = g.reshape(-1, g.size(-1)).sum(0) if ctx.has_bias else None
        grad_x = comm.reduce_scatter(g @ weight, comm.SEQ_DIM, ctx.group)  # (B, T/t, in)
        return grad_x, grad_weight, grad_bias, None


def _sharded(t: torch.Tensor, dim: int) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone())
    p.tp_shard_dim = dim
    return p


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows (and b) split across the group: y is sharded on its
    last dim unless `gather_output`.

    Args:
        weight, bias: this rank's rows (out_features / t, in_features) and (out_features / t,).
        group: the tensor-parallel process group.
        gather_output: all-gather y so every rank holds it whole (not needed before a
            row-parallel layer or the vocab-parallel loss).
        sequence_parallel: the input is sharded along the sequence; all-gather it first.
        recompute_gather: under sequence parallelism, save only this rank's shard of the input
            for backward and all-gather it again there (Megatron's choice): the saved input
            shrinks t-fold, each backward moves one more all-gather of b*s*h.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 recompute_gather: bool = False):
        super().__init__()
        if recompute_gather and not sequence_parallel:
            raise ValueError("ColumnParallelLinear: recompute_gather=True needs "
                             "sequence_parallel=True (there is no gather to recompute)")
        self.weight = _sharded(weight, 0)
        self.bias = None if bias is None else _sharded(bias, 0)
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.recompute_gather = sequence_parallel, recompute_gather

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, *, chunks: int = 1, gather_output: bool = False,
                    sequence_parallel: bool = False,
                    recompute_gather: bool = False) -> ColumnParallelLinear:
        """This rank's slice of `linear` (`chunks`: fused blocks split one by one, see
        `shard_rows`)."""
        if gather_output and chunks > 1:
            raise ValueError("ColumnParallelLinear: gather_output with chunks > 1 would interleave "
                             "the blocks; gather each block's output instead")
        r, t = comm.group_rank(group), comm.group_size(group)
        bias = None if linear.bias is None else shard_rows(linear.bias, r, t, chunks)
        return cls(shard_rows(linear.weight, r, t, chunks), bias, group,
                   gather_output=gather_output, sequence_parallel=sequence_parallel,
                   recompute_gather=recompute_gather)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_gather:
            y = _LinearOfGathered.apply(x, self.weight, self.bias, self.group)
            return comm.gather_from_region(y, self.group) if self.gather_output else y
        if self.sequence_parallel:
            x = comm.gather_from_sequence(x, self.group)  # (B, T/t, C) -> (B, T, C)
        else:
            x = comm.copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/t)
        return comm.gather_from_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.size(1)}, local_out_features={self.weight.size(0)}, "
                f"tp={comm.group_size(self.group)}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split across the group; the partial products are
    summed (all-reduce, or reduce-scatter along the sequence), then b is added once.

    Args:
        weight: this rank's columns (out_features, in_features / t); bias: all of it.
        group: the tensor-parallel process group.
        input_is_parallel: x is already this rank's slice of the last dim (after a
            column-parallel layer); False splits a replicated x first.
        sequence_parallel: reduce-scatter the output along the sequence instead of
            all-reducing it; the bias's gradient is then summed over the group.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.weight = _sharded(weight, 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and self.bias is not None:
            comm.sum_grad_over_group(self.bias, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, *, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        r, t = comm.group_rank(group), comm.group_size(group)
        weight = shard_rows(linear.weight.t(), r, t).t()
        return cls(weight, linear.bias, group, input_is_parallel=input_is_parallel,
                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.split_to_region(x, self.group)
        y = F.linear(x, self.weight)  # (B, T, out) partial sum of this rank's columns
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence(y, self.group)  # (B, T/t, out)
        else:
            y = comm.reduce_from_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"local_in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, "
                f"tp={comm.group_size(self.group)}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (token ids) are split across the group: each rank looks up the
    ids it holds, writes zeros for the others, and an all-reduce sums the one non-zero row in.

    Args:
        weight: this rank's rows (vocab_size / t, embedding_dim).
        group: the tensor-parallel process group.
    """

    def __init__(self, weight: torch.Tensor, group):
        super().__init__()
        self.weight = _sharded(weight, 0)
        self.group = group
        self.vocab_start = comm.group_rank(group) * weight.size(0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group) -> VocabParallelEmbedding:
        for name in ("padding_idx", "max_norm"):
            if getattr(embedding, name) is not None:
                raise ValueError(f"VocabParallelEmbedding: nn.Embedding({name}="
                                 f"{getattr(embedding, name)}) is not supported; build the "
                                 f"embedding without {name}")
        r, t = comm.group_rank(group), comm.group_size(group)
        return cls(shard_rows(embedding.weight, r, t), group)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.size(0))  # (B, T): another rank's ids
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return comm.reduce_from_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"vocab_start={self.vocab_start}, local_rows={self.weight.size(0)}, "
                f"embedding_dim={self.weight.size(1)}, tp={comm.group_size(self.group)}")
