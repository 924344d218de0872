"""The one layout of ranks: dp x pp x tp, and its process groups, made once.

`Grid` is pure index math (unit-tested without processes); `create_process_groups` makes every
axis's groups on a running job and hands this rank's back in a frozen object, never a global
(picotron's process-group manager, without its global).

Layout: tp is innermost, then pp, then dp:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

- a tensor-parallel group is `tp` consecutive ranks: they exchange activations several times
  per layer, so they belong on one host (consecutive ranks share a node under
  `--nproc-per-node`);
- a pipeline is the ranks of one (dp_rank, tp_rank) across the stages: stage s and s + 1 of
  the same tp rank exchange each micro-batch's boundary (its tp slice is the same one);
- a data-parallel group is the ranks of one (pp_rank, tp_rank): they hold the same slice of the
  same stage, and average its gradients.

With `world_size=8, pp=2, tp=2`: tp groups [0, 1] [2, 3] [4, 5] [6, 7]; pipelines [0, 2]
[1, 3] [4, 6] [5, 7]; dp groups [0, 4] [1, 5] [2, 6] [3, 7]. With tp=1 it is the dp x pp layout
of `--strategy pipeline`, with pp=1 the dp x tp one of `--strategy tp`.

    python -c "from ringtrain.grid import Grid; print(Grid(8, pp=2, tp=2).coords(5))"
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple

import torch.distributed as dist


class Coords(NamedTuple):
    """A rank's place on the three axes."""

    dp_rank: int
    pp_rank: int
    tp_rank: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Grid:
    """`world_size` ranks as `dp` replicas of `pp` stages of `tp` tensor-parallel ranks each.

    Args:
        world_size: number of ranks in the job.
        pp: pipeline-parallel degree (stages per pipeline).
        tp: tensor-parallel degree (ranks that split every matrix); pp x tp must divide
            `world_size`, and dp is what is left.
    """

    world_size: int
    _: KW_ONLY
    pp: int = 1
    tp: int = 1
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: it must be at least 1")
        for axis, n in (("pp", self.pp), ("tp", self.tp)):
            if n < 1:
                raise ValueError(f"{axis}={n}: the degree of each parallelism must be at least 1")
        model = self.pp * self.tp  # ranks one replica of the model needs
        if self.world_size % model:
            axes = [(a, n) for a, n in (("pp", self.pp), ("tp", self.tp)) if n > 1]
            what = " x ".join(f"{a}={n}" for a, n in axes)
            flags = " and ".join(f"--{a}" for a, _ in axes)
            low = self.world_size // model * model
            multiples = " or ".join(str(m) for m in (low, low + model) if m > 0)
            choice = "in" if len(axes) == 1 else "whose product is in"
            raise ValueError(
                f"world_size={self.world_size} is not divisible by {what}: every "
                f"data-parallel replica needs all {model} ranks of one model. Use "
                f"--nproc-per-node {multiples} (a multiple of {model}), or {flags} {choice} "
                f"{_divisors(self.world_size)}")
        object.__setattr__(self, "dp", self.world_size // model)

    def coords(self, rank: int) -> Coords:
        """`(dp_rank, pp_rank, tp_rank)` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}]")
        replica, tp_rank = divmod(rank, self.tp)
        dp_rank, pp_rank = divmod(replica, self.pp)
        return Coords(dp_rank, pp_rank, tp_rank)

    def rank_of(self, dp_rank: int, pp_rank: int = 0, tp_rank: int = 0) -> int:
        """The global rank at `(dp_rank, pp_rank, tp_rank)`."""
        if not (0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp and 0 <= tp_rank < self.tp):
            raise ValueError(f"(dp_rank={dp_rank}, pp_rank={pp_rank}, tp_rank={tp_rank}) is "
                             f"outside dp={self.dp} x pp={self.pp} x tp={self.tp}")
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def tp_group_ranks(self, dp_rank: int, pp_rank: int = 0) -> list[int]:
        """Global ranks that split stage `pp_rank` of replica `dp_rank`, by tp_rank."""
        return [self.rank_of(dp_rank, pp_rank, t) for t in range(self.tp)]

    def pp_group_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """Global ranks of the pipeline of replica `dp_rank` and slice `tp_rank`, stage order."""
        return [self.rank_of(dp_rank, s, tp_rank) for s in range(self.pp)]

    def dp_group_ranks(self, pp_rank: int = 0, tp_rank: int = 0) -> list[int]:
        """Global ranks that hold slice `tp_rank` of stage `pp_rank`, by dp_rank."""
        return [self.rank_of(d, pp_rank, tp_rank) for d in range(self.dp)]

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each axis, in the order `create_process_groups` makes them."""
        return {
            "tp": [self.tp_group_ranks(d, s) for d in range(self.dp) for s in range(self.pp)],
            "pp": [self.pp_group_ranks(d, t) for d in range(self.dp) for t in range(self.tp)],
            "dp": [self.dp_group_ranks(s, t) for s in range(self.pp) for t in range(self.tp)],
        }


@dataclass(frozen=True)
class GridGroups:
    """One rank's place in a `Grid` and the process groups of its three axes."""

    grid: Grid
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_ranks: tuple[int, ...]  # this slice of this stage's data-parallel peers, by dp_rank
    pp_ranks: tuple[int, ...]  # this rank's pipeline (same dp_rank, tp_rank), stage order
    tp_ranks: tuple[int, ...]  # the ranks that split this stage with this one, by tp_rank

    @property
    def pp_is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last_stage(self) -> bool:
        return self.pp_rank == self.grid.pp - 1


def create_process_groups(grid: Grid, rank: int | None = None) -> GridGroups:
    """Create every group of every axis (tp, then pp, then dp); return this rank's.

    A collective call: `dist.new_group` is collective, so every rank of the default group
    creates every group, in the same order (torch's `new_subgroups_by_enumeration`, one
    `new_group` per row), and keeps its own. An axis of degree 1 still gets its (one-rank)
    groups, so callers never ask whether it exists.
    """
    if rank is None:
        rank = dist.get_rank()
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"grid is for world_size={grid.world_size} but the process group has "
                         f"{dist.get_world_size()} ranks; build Grid({dist.get_world_size()}, "
                         "pp=..., tp=...)")
    c = grid.coords(rank)
    made = {axis: dist.new_subgroups_by_enumeration(rows)[1]
            for axis, rows in grid.groups().items()}
    tp_ranks = grid.tp_group_ranks(c.dp_rank, c.pp_rank)
    pp_ranks = grid.pp_group_ranks(c.dp_rank, c.tp_rank)
    dp_ranks = grid.dp_group_ranks(c.pp_rank, c.tp_rank)
    return GridGroups(
        grid, rank, *c,
        dp_group=made["dp"][c.pp_rank * grid.tp + c.tp_rank],
        pp_group=made["pp"][c.dp_rank * grid.tp + c.tp_rank],
        tp_group=made["tp"][c.dp_rank * grid.pp + c.pp_rank],
        dp_ranks=tuple(dp_ranks), pp_ranks=tuple(pp_ranks), tp_ranks=tuple(tp_ranks))


def create_pp_grad_groups(grid: Grid, rank: int | None = None) -> dist.ProcessGroup:
    """A second group of this rank's pipeline (the ranks of its `pp_group`), for the gradients
    that go back while activations go forward (`PipelineStage(grad_group=...)`).

    A collective call, as `create_process_groups` (every rank makes every pipeline's). Worth
    it on gloo: a group is one TCP connection per pair of ranks, and on one connection a
    gradient sent back while the next activation came forward stalled a 1F1B step by 2-5 ms
    (a 2-stage GPT of width 32, M = 8: median step 12.1 ms on one group, 5.7 ms on two).
    NCCL's send/recv do not share a socket this way; it keeps one group (no second
    communicator).
    """
    if rank is None:
        rank = dist.get_rank()
    c = grid.coords(rank)
    made = dist.new_subgroups_by_enumeration(grid.groups()["pp"])[1]
    return made[c.dp_rank * grid.tp + c.tp_rank]
