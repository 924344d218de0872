"""Live ZeRO's snapshots: the whole state as one rank's part, on the members' rank 0.

    agreement = StopVoteAgreement(current, gather=hooks.gather_for_stop)   # the loop's
    part = one_rank_part([part_of_rank_0, part_of_rank_1, ...])            # what rank 0 saves

In a live job the members' rank 0 writes the snapshots alone, so it must hold every member's
shard: `ZeroLiveHooks` (`zero_live.py`) has every member send it its shard in a step after
which the trainer saves, and rank 0 keeps them as one rank's part (`one_rank_part`), the form
a snapshot resumed on any number of ranks reads (`ringtrain.zero.reshard`). A stop signal
between two such steps is agreed in the loop's stop vote, which then gathers the shards too
(`StopVoteAgreement`), so the stop's snapshot is of the step it stops at, as without --live.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringtrain.agreement.generations import GenerationAgreement
from ringtrain.zero import reshard

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["StopVoteAgreement", "one_rank_part"]

log = logging.getLogger("ringtrain")


class StopVoteAgreement(GenerationAgreement):
    """The live loop's agreement over the current generation (`GenerationAgreement`), whose
    stop vote, when it says stop, also gathers the shards to the members' rank 0: the vote is
    the last question every member answers before a stop, and a stop saves a snapshot on rank
    0 alone, which must hold the whole state.

    A member lost inside that gather leaves rank 0 without the state: its save then fails
    loudly and the last periodic snapshot resumes the run (`ZeroLiveHooks.snapshot_state`).

    Args:
        current: the current generation's runtime (rank, size, group).
        gather: every member, once the vote said stop: the shards to rank 0
            (`ZeroLiveHooks.gather_for_stop`).
    """

    def __init__(self, current: Callable[[], Runtime], gather: Callable[[], None]):
        super().__init__(current)
        self.gather_for_stop = gather

    def vote(self, flag: bool, *, at_shared_step: bool) -> bool:
        stop = super().vote(flag, at_shared_step=at_shared_step)
        if stop:
            try:
                self.gather_for_stop()
            except RuntimeError as e:  # a member lost: the stop goes on, without the state
                log.warning("live: the ZeRO shards could not be gathered for the stop's "
                            "snapshot (%s)", str(e).splitlines()[0])
        return stop


def one_rank_part(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every saved rank's part (with parameters) -> the same state as one rank's part, the form
    a snapshot of any number of ranks resumes from (`reshard.consolidate`)."""
    full = reshard.consolidate(parts)
    some = parts[0]
    return {**{k: some[k] for k in ("format", "stage", "numels", "names", "shapes",
                                    "param_groups")},
            "world_size": 1, "rank": 0, "shards": full["params"], "moments": full["moments"],
            "scalars": full["scalars"]}
