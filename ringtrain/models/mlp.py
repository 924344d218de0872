"""A residual MLP: few large matmuls, the opposite of the GPT's many small ops.

    python -c "from ringtrain.models.mlp import residual_mlp; print(residual_mlp(2, 64, 256))"

The benchmarks use it where they need a model whose time is all in Linear layers
(`ddp_vs_torch`, `zero_vs_torch`, `dp_vs_ddp`'s mlp). Like every model here it imports nothing
of distribution.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """x + fc2(gelu(fc1(x))): (B, dim) -> (B, dim)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def residual_mlp(blocks: int, dim: int, hidden: int, seed: int | None = 0) -> nn.Sequential:
    """`blocks` ResidualBlocks in a Sequential, initialized from `seed` (None: the current RNG)."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(*(ResidualBlock(dim, hidden) for _ in range(blocks)))
