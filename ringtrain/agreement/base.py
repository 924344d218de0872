"""What ranks must agree on, and its lockstep form: collectives over the world group.

    agreement = strategy.agreement(runtime, "trainer")   # the strategy picks the kind
    loss_sum, count = agreement.sum([loss_sum, count])    # every rank, same order
    stop = agreement.vote(got_sigterm, at_shared_step=logged)
    digests = agreement.gather("74000fa9...")             # rank -> text

The trainer asks these questions on every rank in the same order and never asks which kind of
agreement it holds. Lockstep strategies (DDP, pipeline, synchronous parameter server) answer
with collectives; strategies whose ranks drift apart answer through the store
(`ringtrain.agreement.store`), so a rank that died does not stop the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives


class Agreement(ABC):
    """Sums, votes and digests that come out the same on every rank (of those still in the job)."""

    @abstractmethod
    def sum(self, values: list[float]) -> list[float]:
        """`values` summed over the ranks, bit-identical on every rank (float64)."""

    def try_sum(self, values: list[float]) -> list[float] | None:
        """`sum`, or None where the ranks could not agree: a live job's member was lost in the
        middle of the question (`GenerationAgreement`). Every other agreement either answers
        or raises, so by default it is `sum`."""
        return self.sum(values)

    @abstractmethod
    def vote(self, flag: bool, *, at_shared_step: bool) -> bool:
        """True on every rank when any rank's `flag` is True (a stop signal).

        `at_shared_step`: this step is one every rank reaches together (a metrics step). Called
        on every rank at every step; an agreement whose ranks drift may answer False elsewhere.
        """

    @abstractmethod
    def gather(self, text: str) -> dict[int, str]:
        """Every rank's `text` (a digest), by rank."""

    def absent_ranks(self) -> list[int]:
        """Ranks that have left the job, the same list on every rank (a snapshot needs them all).

        Called at the same points on every rank; lockstep jobs lose no rank and go on.
        """
        return []


class CollectiveAgreement(Agreement):
    """Lockstep agreement: one collective over `process_group` per question.

    Args:
        process_group: the world group (None: torch's default group).
        world_size: ranks in the group; with 1 every answer is local (no collective).
        vote_every_step: False votes at shared (metrics) steps only: for strategies whose
            ranks meet rarely on purpose (local SGD over a slow link), where a vote every step
            would cost a round trip every step.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int, *,
                 vote_every_step: bool = True):
        self.process_group, self.world_size = process_group, world_size
        self.vote_every_step = vote_every_step

    def sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        collectives.all_reduce(t, group=self.process_group)
        return t.tolist()

    def vote(self, flag: bool, *, at_shared_step: bool) -> bool:
        """One int all-reduced (MAX) at every step, so every rank stops at the same step.

        Cheap enough for every step boundary: on gloo with 2 ranks it takes ~0.2 ms (median; a
        few ms at the 90th percentile on a loaded 2-core machine), against tens of ms per step.
        """
        if self.world_size == 1:
            return flag
        if not (self.vote_every_step or at_shared_step):
            return False
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(t.item())

    def gather(self, text: str) -> dict[int, str]:
        if self.world_size == 1:
            return {0: text}
        out: list[str] = [""] * self.world_size
        collectives.all_gather_object(out, text, group=self.process_group)
        return dict(enumerate(out))
