"""benchmarks/live_recovery.py's emulated device (`--device-time`), in process.

    .venv/bin/pytest -q tests/test_live_recovery_bench.py

A member's step with `device_s` trains its share on each sample's first `tokens` tokens (the
same loss a plain loop computes on them) and then waits `device_s` per sample, as its own GPU
would: a share of 11 samples (3 members of a 32-sample batch) waits 11/8 of one of 8. The whole
benchmark needs root and ~50 min (docs/fault_tolerance.md, session 24); this checks its parts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import live_recovery  # noqa: E402
import live_recovery_worker as worker  # noqa: E402

CONFIG = {"model": {"n_layer": 1, "n_embd": 32, "block_size": 16}, "global_batch": 32,
          "tokens": 4, "device_s": 0.02}


def test_the_emulated_step_trains_the_first_tokens_and_waits_per_sample():
    model, optimizer, tokens, _ = worker.build(CONFIG)
    reference = [p.detach().clone() for p in model.parameters()]
    ids = list(range(11))
    # The loss a plain loop computes on the same 4 tokens of each sample, over the global batch.
    x, y = tokens[ids, :4], tokens[ids, 1:5]
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / (32 * 4)
    step = worker.make_step(model, optimizer, tokens, CONFIG)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    start = time.monotonic()
    loss = step(ids, group)
    waited = time.monotonic() - start
    assert waited >= 11 * CONFIG["device_s"]
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    assert any(not torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))


def test_options_default_tokens_to_the_block_and_refuse_what_cannot_run(capsys):
    a = live_recovery.parse(["--device-time", "0.12"])
    assert (a.tokens, a.device_time) == (a.block_size, 0.12)
    assert live_recovery.parse(["--tokens", "16"]).tokens == 16
    for argv in (["--tokens", "129"], ["--tokens", "0"], ["--device-time", "-1"]):
        with pytest.raises(SystemExit) as e:
            live_recovery.parse(argv)
        assert e.value.code == 2
    assert "the tokens must be 1 to the block size (128)" in capsys.readouterr().err
