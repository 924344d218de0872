"""Many multi-rank scenarios in one `run_workers` start, each reported by its own test.

    SCENARIOS = {"pickle": _pickle, "ignored": _ignored}   # fn(rank, world_size) -> result

    @pytest.fixture(scope="module")
    def sessions():
        return scenario_session(SCENARIOS)

    def test_pickle(sessions):
        rank0, rank1 = sessions("pickle")

One start of the ranks for the whole module (a start costs seconds; a scenario, a fraction).
A scenario that raises fails only its own test, with that rank's traceback; a session that
does not start fails each test that asks for it, once, without starting again.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest

from ringtrain.testing import run_workers


def run_scenarios(rank: int, world_size: int, scenarios: dict[str, Callable]) -> dict:
    """On each rank: every scenario in order, ("ok", result) or ("error", traceback) by name."""
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = ("ok", fn(rank, world_size))
        except Exception:  # noqa: BLE001 - reported by the test of this scenario
            out[name] = ("error", traceback.format_exc())
    return out


def scenario_session(scenarios: dict[str, Callable], world_size: int = 2,
                     timeout_s: float = 150) -> Callable[[str], list]:
    """`results(name)`: that scenario's per-rank results; the ranks start at the first call."""
    started: list = []

    def results(name: str) -> list:
        if not started:
            try:
                started.append(run_workers(run_scenarios, world_size, args=(scenarios,),
                                           timeout_s=timeout_s))
            except Exception as e:  # noqa: BLE001 - report once per test, do not restart
                started.append(e)
        if isinstance(started[0], Exception):
            pytest.fail(f"the {world_size}-rank session failed: {started[0]}")
        values = []
        for rank, out in enumerate(started[0]):
            status, value = out[name]
            if status == "error":
                pytest.fail(f"rank {rank}, scenario {name!r}:\n{value}")
            values.append(value)
        return values

    return results
