"""The 2-D layout of ranks for data x tensor parallelism, and its process groups.

`Grid` is pure index math (unit-tested without processes); `create_process_groups` makes the
per-axis groups on a running job once and hands them back in a frozen object, never a global
(as `ringtrain.pipeline.topology` does for dp x pp).

Layout: tp is innermost, the ranks of one tensor-parallel group are consecutive,
`rank = dp_rank * tp + tp_rank`: they exchange activations several times per layer, so they
belong on one host (consecutive ranks share a node under `--nproc-per-node`). With
`world_size=4, tp=2` the tp groups are [0, 1] and [2, 3], the data-parallel groups [0, 2]
and [1, 3] (the ranks that hold the same slice of every matrix).

    python -c "from ringtrain.tensor_parallel.grid import Grid; print(Grid(4, tp=2).coords(3))"
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Grid:
    """`world_size` ranks as `dp` replicas of `tp` tensor-parallel ranks each.

    Args:
        world_size: number of ranks in the job.
        tp: tensor-parallel degree; must divide `world_size`.
    """

    world_size: int
    tp: int
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.tp < 1:
            raise ValueError(f"world_size={self.world_size}, tp={self.tp}: both must be >= 1")
        if self.world_size % self.tp:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp={self.tp}: every "
                f"data-parallel replica needs all {self.tp} tensor-parallel ranks. Use "
                f"--nproc-per-node a multiple of {self.tp}, or --tp in {divisors}")
        object.__setattr__(self, "dp", self.world_size // self.tp)

    def coords(self, rank: int) -> tuple[int, int]:
        """`(dp_rank, tp_rank)` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}]")
        return divmod(rank, self.tp)

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of replica `dp_rank`'s tensor-parallel group, by tp_rank."""
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        """Global ranks that hold slice `tp_rank` of every matrix, by dp_rank."""
        return [d * self.tp + tp_rank for d in range(self.dp)]


@dataclass(frozen=True)
class GridGroups:
    """One rank's place in a `Grid` and the process groups of its two axes."""

    grid: Grid
    rank: int
    dp_rank: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup


def create_process_groups(grid: Grid, rank: int | None = None) -> GridGroups:
    """Create every tp group and every dp group; return this rank's.

    A collective call: `dist.new_group` is collective, so every rank creates every group, in
    the same order, and keeps its own.
    """
    if rank is None:
        rank = dist.get_rank()
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"grid is for world_size={grid.world_size} but the process group has "
                         f"{dist.get_world_size()} ranks; build Grid({dist.get_world_size()}, "
                         "tp=...)")
    dp_rank, tp_rank = grid.coords(rank)
    # torch's helper makes every group of each axis in order (one new_group per row).
    _, tp_groups = dist.new_subgroups_by_enumeration(
        [grid.tp_group_ranks(d) for d in range(grid.dp)])
    _, dp_groups = dist.new_subgroups_by_enumeration(
        [grid.dp_group_ranks(t) for t in range(grid.tp)])
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    return GridGroups(grid, rank, dp_rank, tp_rank, tp_group, dp_group)
