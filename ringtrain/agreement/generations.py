"""`GenerationAgreement`: the questions of a live job, over whoever is a member now.

    agreement = GenerationAgreement(lambda: driver.runtime)   # the current generation's place

A live job (`ringtrain train --live`) changes its process group whenever a member is lost or
let in (`ringtrain.live.LiveGroup`); its groups are built directly on the store, outside torch's
registry, so each question calls the group's own methods. A question whose collective fails (a
member lost after the step committed) is answered locally: a stop vote counts this member's
flag, a digest is this member's; a sum says it failed (`try_sum`), and the trainer holds that
metrics line until the next generation agrees on it (the survivors' sums). The failure is kept
(`take_failure`) for the live driver, which recovers at the start of the next step, so a
recovery happens at one place, the step, and at once: a round of local SGD or DiLoCo has no
collective of its own until its meeting, and two members lost in one round would otherwise be
found together there, a member and the only copy of its moments with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.agreement.base import Agreement
from ringtrain.runtime import Runtime

__all__ = ["GenerationAgreement"]

log = logging.getLogger("ringtrain")


class GenerationAgreement(Agreement):
    """Sums, votes and digests over the current generation's group (`current().process_group`,
    `current().rank` of `current().world_size`)."""

    def __init__(self, current: Callable[[], Runtime]):
        self.current = current
        self._failed: str | None = None  # the first failure since `take_failure`

    def take_failure(self) -> str | None:
        """The first question that failed since the last call (a member lost), or None."""
        failed, self._failed = self._failed, None
        return failed

    def _lost(self, what: str, e: RuntimeError) -> None:
        reason = str(e).splitlines()[0]
        log.warning("live: %s failed (%s); answered locally", what, reason)
        self._failed = self._failed or reason

    def _group(self) -> Any | None:
        rt = self.current()
        return rt.process_group if rt.world_size > 1 else None

    def _reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor | None:
        pg = self._group()
        if pg is None:
            return t
        options = dist.AllreduceOptions()
        options.reduceOp = op
        try:
            pg.allreduce([t], options).wait()
        except RuntimeError as e:  # a member lost: the next step recovers (module docstring)
            self._lost("a sum or vote", e)
            return None
        return t

    def sum(self, values: list[float]) -> list[float]:
        out = self.try_sum(values)
        return list(values) if out is None else out

    def try_sum(self, values: list[float]) -> list[float] | None:
        """The sum over the generation; None where it failed (the trainer then holds that
        metrics line for the next generation's reduction: `ringtrain.training.record`)."""
        t = self._reduce(torch.tensor(values, dtype=torch.float64), dist.ReduceOp.SUM)
        return None if t is None else t.tolist()

    def vote(self, flag: bool, *, at_shared_step: bool) -> bool:
        t = self._reduce(torch.tensor([1 if flag else 0], dtype=torch.int32), dist.ReduceOp.MAX)
        return flag if t is None else bool(t.item())

    def gather(self, text: str) -> dict[int, str]:
        pg, rank = self._group(), self.current().rank
        if pg is None:
            return {rank: text}
        data = torch.tensor(list(text.encode()), dtype=torch.uint8)
        size = pg.size()
        try:
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
            pg.allgather([lengths], [torch.tensor([data.numel()])]).wait()
            width = max(int(n) for n in lengths)
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[:data.numel()] = data
            out = [torch.empty_like(padded) for _ in range(size)]
            pg.allgather([out], [padded]).wait()
        except RuntimeError as e:
            self._lost("a gather", e)
            return {rank: text}
        return {r: bytes(out[r][:int(lengths[r])].tolist()).decode() for r in range(size)}
