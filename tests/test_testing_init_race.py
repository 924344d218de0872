"""run_workers' start: `fn` runs once every rank has joined the group, so a worker function that
returns right after init breaks no peer.

    .venv/bin/pytest -q tests/test_testing_init_race.py     # RINGTRAIN_FULL=1: 40 runs

gloo connects every pair of ranks inside `init_process_group`, and a rank leaves it once its own
pairs are up: a function that returns at once (no collective) could destroy its group while the
other rank was still in gloo's connectFullMesh ("Connection closed by peer"; seen 1 run in 20 in
session 11, not reproduced here in 340 runs of 2-4 ranks, with and without two CPU burners).
`ringtrain.testing._worker` holds every rank in one barrier after init. The test runs a function
that returns at once, several times back to back, and checks it started after that barrier (the
group's sequence number is 1 there; 0 without it, which fails on a tree without the barrier).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ringtrain.testing import run_workers
from ringtrain.torch_internals import sequence_number

FULL = os.environ.get("RINGTRAIN_FULL") == "1"
RUNS = 40 if FULL else 5  # ~0.25 s a run of 2 ranks on a quiet machine


def _returns_at_once(rank, world_size):
    return sequence_number(dist.group.WORLD)  # a local read: no collective


def test_a_worker_that_returns_right_after_init_starts_after_the_whole_group_is_up():
    for run in range(RUNS):
        assert run_workers(_returns_at_once, 2, timeout_s=60) == [1, 1], f"run {run}"
