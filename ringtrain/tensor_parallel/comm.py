"""What crosses ranks in tensor parallelism: the region boundaries, as autograd Functions.

Megatron-LM (Shoeybi et al. 2019, sec. 3, the f and g operators; Korthikanti et al. 2022 for
the sequence-parallel ones) names each boundary by its forward; its backward is the conjugate:

    copy_to_region           forward: identity              backward: all-reduce
    reduce_from_region       forward: all-reduce            backward: identity
    gather_from_region       forward: all-gather (last dim) backward: split (last dim)
    split_to_region          forward: split (last dim)      backward: all-gather (last dim)
    gather_from_sequence     forward: all-gather (seq dim)  backward: reduce-scatter (seq dim)
    reduce_scatter_to_sequence forward: reduce-scatter      backward: all-gather (seq dim)
    split_to_sequence        forward: split (seq dim)       backward: all-gather (seq dim)

The sequence dimension is dim 1 of ringtrain's (B, T, C) activations (Megatron keeps (T, B, C)
so it can gather dim 0 without a copy; we pay one movedim copy instead of changing the model).
All calls take the process group explicitly and go through `ringtrain.collectives.check`, so
`RINGTRAIN_DEBUG=collectives` names a rank that skipped one. On gloo the reduce-scatter is the
send/recv ring of `ringtrain.rings` (gloo's own is ~4x slower at 4 MiB); elsewhere torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives, rings

SEQ_DIM = 1  # (B, T, C)


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


# ---- the collectives (how) ----------------------------------------------------------------------

def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) of `x` over the group, in a new tensor (autograd may still hold `x`)."""
    x = x.contiguous().clone()
    collectives.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    # torch's call on every backend: on gloo `all_gather_into_tensor` is as fast as the ring of
    # `ringtrain.rings` (3.3 ms at 4 MiB on 2 ranks; the rings' docstring), unlike reduce-scatter.
    t = group_size(group)
    front = x.movedim(dim, 0).contiguous()  # all_gather_into_tensor concatenates dim 0
    out = front.new_empty((t * front.size(0), *front.shape[1:]))
    collectives.check("all_gather_single", [front], group)
    _renamed("all_gather_single", "all_gather_into_tensor")(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum over the group of `x`, of which this rank keeps its 1/t slice along `dim`."""
    t = group_size(group)
    _check_divisible(x, dim, t, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.size(0) // t, *front.shape[1:]))
    collectives.check("reduce_scatter_single", [front], group)
    if dist.get_backend(group) == "gloo":
        # gloo reduces once per rank: 2 ranks, 4 MiB fp32, median 3.8 ms against 0.97 ms for
        # the send/recv ring (and 2.7 ms for an all-reduce of the whole; session 29); this
        # function, copies included, 4.1-5.0 -> 2.0-2.3 ms (1 MiB: 0.76 -> ~0.5 ms). Chunk r
        # of the flat `front` is rank r's slice (dim 0 is split, t divides it): the ring's layout.
        rings.reduce_scatter(out.view(-1), front.view(-1), group).wait()
    else:  # NCCL's own is the right one on GPUs
        _renamed("reduce_scatter_single", "reduce_scatter_tensor")(out, front, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/t slice of `x` along `dim` (no communication)."""
    t = group_size(group)
    _check_divisible(x, dim, t, "split")
    n = x.size(dim) // t
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


def _renamed(new: str, old: str):
    """torch 2.13 calls them *_single and warns on the old names, which 2.11 alone has."""
    return getattr(dist, new, None) or getattr(dist, old)


def _check_divisible(x: torch.Tensor, dim: int, t: int, what: str) -> None:
    if x.size(dim) % t:
        raise ValueError(
            f"tensor parallelism: cannot {what} a tensor of shape {tuple(x.shape)} along dim {dim} "
            f"into {t} equal parts ({x.size(dim)} % {t} = {x.size(dim) % t}); with sequence "
            f"parallelism the sequence length must be a multiple of the tp degree: use "
            f"T={x.size(dim) - x.size(dim) % t or t} or pad the batch")


# ---- the region boundaries (what) ---------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return split(g, -1, ctx.group), None


class _SplitToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, -1, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, SEQ_DIM, ctx.group), None


class _SplitToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, SEQ_DIM, ctx.group), None


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input (Megatron's f)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a region whose ranks hold partial sums (Megatron's g)."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a region whose ranks hold slices of the last dim: the full tensor on every rank."""
    return _GatherFromRegion.apply(x, group)


def split_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a region that wants this rank's slice of the last dim of a replicated input."""
    return _SplitToRegion.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded (B, T/t, C) -> full (B, T, C): replaces copy_to_region under SP."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums (B, T, C) -> this rank's summed (B, T/t, C): replaces reduce_from_region."""
    return _ReduceScatterToSequence.apply(x, group)


def split_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated (B, T, C) -> this rank's (B, T/t, C): where a sequence-parallel run starts."""
    return _SplitToSequence.apply(x, group)


def sum_grad_over_group(param: nn.Parameter, group) -> None:
    """Make `param`'s gradient the sum over the group, as each backward produces it.

    For parameters replicated on every rank but used on a slice of the sequence only (the layer
    norms and the row-parallel biases under sequence parallelism): each rank's gradient covers
    its tokens, and the true gradient is their sum. The hook sees one backward's contribution,
    before accumulation into `.grad`, so gradient accumulation stays correct. Every rank runs
    the same graph, so the hooks fire in the same order everywhere.
    """
    param.register_hook(lambda g: all_reduce(g, group))
