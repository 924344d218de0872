"""A parameter server's `state_dict()` is a consistent cut: no push of the next step in it.

    .venv/bin/pytest -q tests/test_ps_state.py

Found by CI (test_strategy_contract's ps-async seam, 1 run in many): after the first barrier a
worker could start its next step and have its push applied before the server's main thread
copied its shard, so the snapshot held one more update than the workers' clocks said. Here the
server's copy is delayed on purpose, so the race is taken every run.
"""

from __future__ import annotations

import time

import pytest
from test_ps import LRS, batch, ps_strategy  # workers first: rank 0 works, rank 1 serves

from ringtrain.ps.server import ParameterServer
from ringtrain.testing import run_workers


def _cut(rank, world_size, mode):
    s = ps_strategy(mode, 1, "adamw")
    if s.server is not None:  # the server copies its state late: a worker's next push is sent
        copy = ParameterServer.state_dict

        def late(self):
            time.sleep(0.5)
            return copy(self)
        s.server.state_dict = late.__get__(s.server)
    for step in range(2):
        if s.worker is not None:
            s.train_step([batch(step, rank)], lr=LRS[step], grad_clip=None)
    state = s.state_dict()
    if s.worker is not None:
        s.train_step([batch(2, rank)], lr=LRS[2], grad_clip=None)
    s.model_state_dict()
    s.close()
    return state


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_servers_state_holds_the_steps_its_workers_finished(mode):
    worker, server = run_workers(_cut, 2, args=(mode,), timeout_s=60)
    assert worker["clock"] == 2
    # two steps of one worker: two updates, each worker's clock at 2, not 3
    assert server["server"]["version"] == 2 and server["server"]["clocks"] == {0: 2}
