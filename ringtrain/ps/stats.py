"""Running max/mean of an observed quantity (staleness), cheap to merge across servers.

    python -c "from ringtrain.ps.stats import Tally; t = Tally(); t.add(2); t.add(0); print(t.summary('staleness'))"
"""

from __future__ import annotations

from dataclasses import dataclass


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
