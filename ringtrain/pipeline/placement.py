"""Which virtual stage each rank's model chunk holds (pure).

A pipeline of `pp` ranks with `v` chunks each runs `pp * v` virtual stages in order; the
placement says where stage k lives. Two are in use (torch's `generate_stage_to_rank_mapping`
calls them "loop" and "v"):

    loop  chunk c of rank r is stage c*pp + r: stages go down the ranks v times, the last
          rank wrapping to rank 0's next chunk (interleaved 1F1B, Narayanan et al., 2021).
          One chunk per rank (GPipe, 1F1B, ZB-H1) is the same with v = 1.
    V     two chunks: chunk 0 of rank r is stage r, chunk 1 is stage 2*pp-1-r: down the ranks
          and back up (ZB-V, Qi et al., 2024; DualPipe-V). Rank 0 holds the first and the last
          stage, and rank pp-1 holds stages pp-1 and pp: the V's bottom hands its activation
          and gradient over within the rank, with no message.

    .venv/bin/pytest -q tests/test_schedule.py
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where each of the `pp * v` virtual stages lives.

    Args:
        pp: ranks in the pipeline.
        v: chunks per rank.
        v_shape: the V placement (needs v = 2) instead of the loop.
    """

    pp: int
    v: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.v_shape and self.v != 2:
            raise ValueError(f"a V placement holds 2 chunks per rank, not v={self.v}")

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of `rank`'s `chunk`."""
        if self.v_shape and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def where(self, k: int) -> tuple[int, int]:
        """(rank, chunk) of virtual stage `k`."""
        if self.v_shape and k >= self.pp:
            return 2 * self.pp - 1 - k, 1
        return k % self.pp, k // self.pp

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """(rank, chunk) of the stage `step` (+1 next, -1 previous) away from `rank`'s
        `chunk`; None past either end of the pipeline."""
        k = self.stage(rank, chunk) + step
        return self.where(k) if 0 <= k < self.stages else None

    def local(self, rank: int, chunk: int, step: int) -> int | None:
        """The chunk of this same rank that holds the stage `step` away, if one does (the
        bottom of a V): activations and gradients pass to it without a message."""
        other = self.neighbour(rank, chunk, step)
        return other[1] if other is not None and other[0] == rank else None
