"""The 2-D layout of ranks for data x pipeline parallelism, and its process groups.

`Topology` is pure index math (unit-tested without processes); `create_process_groups` makes
the per-axis groups on a running job and hands them back in a frozen object, never a global.

Layout: the stages of one pipeline are adjacent ranks, `rank = dp_rank * pp + pp_rank`, so
with `world_size=4, pp=2` the pipelines are [0, 1] and [2, 3] and the data-parallel groups
(one per stage) are [0, 2] and [1, 3].

    python -c "from ringtrain.pipeline.topology import Topology; print(Topology(4, pp=2).coords(3))"
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """`world_size` ranks as `dp` pipelines of `pp` stages each.

    Args:
        world_size: number of ranks in the job.
        pp: pipeline-parallel degree (stages per pipeline); must divide `world_size`.
    """

    world_size: int
    pp: int
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: it must be at least 1")
        if self.pp < 1:
            raise ValueError(f"pp={self.pp}: the number of pipeline stages must be at least 1")
        if self.world_size % self.pp != 0:
            multiples = sorted({m for m in (self.world_size // self.pp * self.pp,
                                             (self.world_size // self.pp + 1) * self.pp) if m > 0})
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"world_size={self.world_size} is not divisible by pp={self.pp}: every "
                f"data-parallel replica needs all {self.pp} stages. Use --nproc-per-node "
                f"{' or '.join(map(str, multiples))} (a multiple of pp), or --pp in {divisors}"
            )
        object.__setattr__(self, "dp", self.world_size // self.pp)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {self.world_size - 1}]"
            )

    def coords(self, rank: int) -> tuple[int, int]:
        """`(dp_rank, pp_rank)` of a global rank."""
        self._check_rank(rank)
        return divmod(rank, self.pp)

    def rank_of(self, dp_rank: int, pp_rank: int) -> int:
        """The global rank at `(dp_rank, pp_rank)`."""
        if not (0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp):
            raise ValueError(
                f"(dp_rank={dp_rank}, pp_rank={pp_rank}) is outside dp={self.dp} x pp={self.pp}"
            )
        return dp_rank * self.pp + pp_rank

    def pp_group_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of the pipeline that serves data shard `dp_rank`, in stage order."""
        return [self.rank_of(dp_rank, s) for s in range(self.pp)]

    def dp_group_ranks(self, pp_rank: int) -> list[int]:
        """Global ranks that hold stage `pp_rank` (its data-parallel peers), by dp_rank."""
        return [self.rank_of(d, pp_rank) for d in range(self.dp)]


@dataclass(frozen=True)
class ProcessGroups:
    """One rank's place in a `Topology` and the process groups of its two axes."""

    topology: Topology
    rank: int
    dp_rank: int
    pp_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_ranks: tuple[int, ...]  # global ranks of this rank's pipeline, stage order
    dp_ranks: tuple[int, ...]  # global ranks of this stage's data-parallel peers

    @property
    def pp_is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last_stage(self) -> bool:
        return self.pp_rank == self.topology.pp - 1


def create_process_groups(topology: Topology, rank: int | None = None) -> ProcessGroups:
    """Create every pipeline group and every data-parallel group; return this rank's.

    A collective call: every rank of the default group must call it, in the same order,
    because `dist.new_group` is itself collective (all ranks create all groups, then keep
    their own).
    """
    if rank is None:
        rank = dist.get_rank()
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"topology is for world_size={topology.world_size} but the process group has "
            f"{dist.get_world_size()} ranks; build "
            f"Topology(world_size={dist.get_world_size()}, ...)"
        )
    dp_rank, pp_rank = topology.coords(rank)
    # torch's helper makes every group of each axis in order (one new_group per row).
    _, pp_groups = dist.new_subgroups_by_enumeration(
        [topology.pp_group_ranks(d) for d in range(topology.dp)])
    _, dp_groups = dist.new_subgroups_by_enumeration(
        [topology.dp_group_ranks(s) for s in range(topology.pp)])
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
    return ProcessGroups(
        topology, rank, dp_rank, pp_rank, pp_group, dp_group,
        tuple(topology.pp_group_ranks(dp_rank)), tuple(topology.dp_group_ranks(pp_rank)),
    )
