"""Fixtures shared by the test files (pytest finds this file by name).

- `clean_env`: a `ringtrain train` run inside the test process leaves no trace: the launcher's
  variables are unset, and the `ringtrain` logger, the torch thread count and the process group
  are put back afterwards.
- `single_process`: a world of one in this process (1 thread, no report.png), its Runtime.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ringtrain.launch.process_group import destroy_distributed, init_distributed


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
