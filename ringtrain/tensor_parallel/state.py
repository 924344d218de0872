"""A tensor-parallel model's state between its per-rank slices and the whole tensors (pure).

Each parameter is described by a `Split`: the dimension it is split along (None: replicated on
every rank of the group) and the number of fused blocks (q, k, v) split one by one. A snapshot
of tp ranks is turned into the full model's tensors (`unshard`) for a resume on another layout,
and the full tensors into this rank's slices (`shard`) to load one (`ringtrain.strategies.
portable`). The optimizer's per-parameter moments have their parameter's shape: the same rule.

    .venv/bin/pytest -q tests/test_tp_strategy.py -k shard
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.tensor_parallel.attention import HeadParallelAttention


@dataclass(frozen=True)
class Split:
    """How one tensor is held across the tp group: `dim` None is replicated."""

    dim: int | None
    chunks: int = 1


def param_splits(module: nn.Module) -> dict[str, Split]:
    """How each parameter of a parallelised module is held across the tp group, by name (the
    layers mark the dimension they split as `tp_shard_dim`; the fused q, k, v of a
    `HeadParallelAttention` is split block by block; a tied parameter under each of its names).
    Every rank gets the same answer."""
    fused = {id(p) for m in module.modules() if isinstance(m, HeadParallelAttention)
             for p in m.c_attn.parameters()}
    return {name: Split(getattr(p, "tp_shard_dim", None), 3 if id(p) in fused else 1)
            for name, p in module.named_parameters(remove_duplicate=False)}


def shard(full: torch.Tensor, split: Split, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank `tp_rank`'s slice of the whole tensor `full` (a copy)."""
    if split.dim is None or full.dim() == 0:
        return full.clone()
    d, c = split.dim, split.chunks
    size = full.size(d)
    if size % (c * tp):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} has {size} entries along dim "
                         f"{d} ({c} block(s)): not divisible by tp={tp}; choose a --tp that "
                         f"divides {size // c}")
    blocks = full.movedim(d, 0).reshape(c, size // c, *full.movedim(d, 0).shape[1:])
    n = size // c // tp
    part = blocks[:, tp_rank * n:(tp_rank + 1) * n].reshape(-1, *blocks.shape[2:])
    return part.movedim(0, d).clone()


def unshard(parts: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from every tp rank's slice, in tp_rank order (inverse of `shard`)."""
    if split.dim is None or parts[0].dim() == 0:
        return parts[0].clone()
    d, c = split.dim, split.chunks
    fronts = [p.movedim(d, 0) for p in parts]
    per = fronts[0].size(0) // c
    blocks = [f.reshape(c, per, *f.shape[1:]) for f in fronts]  # (c, n, ...) each
    whole = torch.cat(blocks, dim=1)  # (c, tp * n, ...): each block's slices in rank order
    return whole.reshape(-1, *whole.shape[2:]).movedim(0, d).contiguous()


def unshard_named(models: Sequence[Mapping[str, torch.Tensor]],
                  optimizers: Sequence[Mapping[str, Mapping[str, Any]]],
                  splits: Mapping[str, Split]) -> tuple[dict[str, torch.Tensor],
                                                        dict[str, dict[str, Any]]]:
    """Every tp rank's tensors by name (in tp_rank order) -> the whole model's, and its
    optimizer state by parameter name (the moments split as their parameter; scalars kept)."""
    model = {k: unshard([m[k] for m in models], splits.get(k, Split(None))) for k in models[0]}
    optimizer = {name: {key: unshard([o[name][key] for o in optimizers], splits[name])
                        if isinstance(v, torch.Tensor) else v for key, v in entry.items()}
                 for name, entry in optimizers[0].items()}
    return model, optimizer


def shard_named(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Mapping[str, Any]],
                splits: Mapping[str, Split], tp_rank: int,
                tp: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The inverse of `unshard_named`: rank `tp_rank`'s slices of the whole tensors by name
    (optimizer state only for the parameters in `splits`: this rank's model's)."""
    sliced = {k: shard(v, splits.get(k, Split(None)), tp_rank, tp) for k, v in model.items()}
    opt = {name: {key: shard(v, splits[name], tp_rank, tp) if isinstance(v, torch.Tensor) else v
                  for key, v in entry.items()}
           for name, entry in optimizer.items() if name in splits}
    return sliced, opt
