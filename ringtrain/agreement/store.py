"""Agreement through the store, over the ranks still in the job (drifting strategies).

    agreement = StoreAgreement(Membership.of(runtime, "trainer"))

For strategies whose ranks do not move in step and may lose a rank (async/SSP parameter
server): a world collective would wait for, or fail on, a dead rank; the store does not. Each
question is one numbered store round (`Membership.gather`): every rank numbers them alike
because every rank asks the same questions in the same order. Votes are asked only at steps
every rank shares (metrics steps): at other steps the ranks are at different step counts.
"""

from __future__ import annotations

from ringtrain.agreement.base import Agreement
from ringtrain.agreement.membership import Membership


class StoreAgreement(Agreement):
    """`Agreement` through `membership`'s store rounds; the departed are left out of every
    answer."""


    def __init__(self, membership: Membership):
        self.membership = membership
        self._rounds = 0

    def _round(self, what: str) -> str:
        self._rounds += 1
        return f"{what}/{self._rounds}"

    def sum(self, values: list[float]) -> list[float]:
        if self.membership.world_size == 1:
            return list(values)
        return self.membership.reduce(self._round("sum"), values)

    def vote(self, flag: bool, *, at_shared_step: bool) -> bool:
        if not at_shared_step:
            return False
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def gather(self, text: str) -> dict[int, str]:
        got = self.membership.gather(self._round("gather"), text.encode())
        return {r: d.decode() for r, d in got.items()}

    def absent_ranks(self) -> list[int]:
        present = self.membership.gather(self._round("present"), b"")
        return sorted(set(range(self.membership.world_size)) - set(present))
