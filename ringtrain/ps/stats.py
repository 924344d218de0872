"""Running max/mean of an observed quantity (staleness), cheap to merge across servers.

    python -c "from ringtrain.ps.stats import Tally; t = Tally(); t.add(2); t.add(0); \
print(t.summary('staleness'))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Tally:
    """Count, sum and max of integer observations."""

    count: int = 0
    total: int = 0
    max: int = 0

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.max = max(self.max, value)

    def merge(self, other: Tally) -> Tally:
        return Tally(self.count + other.count, self.total + other.total, max(self.max, other.max))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def as_list(self) -> list[float]:
        return [float(self.count), float(self.total), float(self.max)]

    @classmethod
    def from_list(cls, values: list[float]) -> Tally:
        count, total, high = values
        return cls(int(count), int(total), int(high))

    def summary(self, name: str) -> dict[str, float]:
        """{`name`_max, `name`_mean}: the figures a run summary reports."""
        return {f"{name}_max": self.max, f"{name}_mean": round(self.mean, 4)}


def merge_stats(tallies: list[list[float]], *, mode: str, servers: int,
                staleness: int) -> dict[str, Any]:
    """The run's figures from every server's `stats_tensor()` (staleness, update lag, counts)."""
    gap, lag = Tally(), Tally()
    for t in tallies:
        gap = gap.merge(Tally.from_list(t[0:3]))
        lag = lag.merge(Tally.from_list(t[3:6]))
    # Every server sees every push, so the counts repeat per server: keep max and mean.
    return {"ps_mode": mode, "ps_servers": servers,
            "ps_staleness_bound": staleness if mode == "ssp" else None,
            "ps_updates": int(max(t[6] for t in tallies)),
            "ps_workers_lost": int(max(t[7] for t in tallies)),
            **gap.summary("staleness"), **lag.summary("update_lag")}
