"""Fixtures shared by the test files (pytest finds this file by name).

- `clean_env`: a `ringtrain train` run inside the test process leaves no trace: the launcher's
  variables are unset, and the `ringtrain` logger, the torch thread count and the process group
  are put back afterwards.
- `single_process`: a world of one in this process (1 thread, no report.png), its Runtime.
- the device: every test means the CPU (gloo, CPU tensors) unless marked `cuda`. An unmarked
  test runs with RINGTRAIN_DEVICE=cpu, which every process it starts inherits (`ringtrain
  train`, `ringtrain run`, scripts calling `init_distributed()`): on a GPU box "auto" would pick
  NCCL and put two ranks on one GPU. A test marked `cuda` picks the GPU itself and is skipped,
  saying so, where torch sees none.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from ringtrain.launch.device import DEVICE_ENV, cuda_device_count
from ringtrain.launch.process_group import destroy_distributed, init_distributed

# Set at import, before any test module copies os.environ into an ENV of its own.
os.environ[DEVICE_ENV] = "cpu"


@pytest.fixture(autouse=True)
def _device(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv(DEVICE_ENV, "cpu")  # a test that changed it does not leak it
        return
    if cuda_device_count() == 0:
        pytest.skip("needs CUDA: torch sees no GPU here")
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.fixture
def clean_env(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    logger = logging.getLogger("ringtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate, torch.get_num_threads())
    yield
    destroy_distributed()
    logger.handlers[:], logger.level, logger.propagate = saved[:3]  # leave no trace for other tests
    torch.set_num_threads(saved[3])


@pytest.fixture
def single_process(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr("ringtrain.training.report.write_report", lambda *args, **kwargs: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed()
    torch.set_num_threads(threads)
    destroy_distributed()
