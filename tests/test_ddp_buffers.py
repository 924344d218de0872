"""Buffers synced when torch syncs them: rank 0 evaluating alone finishes; a hang is named.

    .venv/bin/pytest -q tests/test_ddp_buffers.py

gloo, CPU, world size 2, and the process group started by plain
`torch.distributed.init_process_group` (no ringtrain launch, so no ringtrain watchdog): the
setting of issue 25's item 7. torch's DDP broadcasts buffers before a forward only when the
forward before it was a synced one (`require_forward_param_sync`), so rank 0's evaluation
forwards under `no_grad` issue one broadcast, which the other rank's next training forward
matches; ringtrain's used to broadcast before every forward and hung there.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.launch.network import reserve_port
from ringtrain.testing import run_workers

REPO = Path(__file__).resolve().parents[1]
CLASSES = {"ours": DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}


class _Causal(nn.Module):
    """A GPT-style block in miniature: a causal-mask buffer, BatchNorm statistics, two Linears."""

    def __init__(self, t: int = 5, d: int = 8):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(t, t)))
        self.proj, self.bn, self.head = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Linear(d, 1)

    def forward(self, x):  # (B, T, D)
        att = (x @ x.transpose(1, 2)).masked_fill(self.mask == 0, float("-inf")).softmax(-1)
        h = self.proj(att @ x).mean(1)  # (B, D)
        return self.head(self.bn(h))


def _evaluate_on_rank0(rank, world_size, port, which):
    # If it hangs, the stack says where (the fixture's bound is 90 s).
    faulthandler.dump_traceback_later(60, exit=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = _Causal()
    ddp = CLASSES[which](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    evals = []
    for _epoch in range(3):
        ddp.train()
        for _ in range(3):
            x, y = torch.randn(4, 5, 8, generator=g), torch.randn(4, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        if rank == 0 and _epoch < 2:  # the others go straight on to the next epoch
            ddp.eval()
            with torch.no_grad():
                evals += [ddp(torch.ones(2, 5, 8) * k) for k in range(4)]
    # Every collective was matched: the one broadcast of an evaluation (gloo's root does not
    # wait for it) by the other rank's first forward of the next epoch.
    dist.barrier()
    # torch's DDP goes before its group: its C++ Reducer holds the group, and freed last (when
    # this function returned) it ran the gloo group's destructor with the GIL held, which
    # joins gloo's worker threads, one of them waiting for the GIL to free the barrier's work:
    # a deadlock in 1 of 60 runs under two burners (py-spy: ~ProcessGroupGloo under
    # pybind11's Reducer dealloc, a worker thread in ~AsyncBarrierWork taking the GIL).
    del ddp
    gc.collect()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return {"state": [t.clone() for t in model.state_dict().values()], "evals": evals}


@pytest.fixture(scope="module")
def evaluated():
    runs = {}
    for which in CLASSES:
        with reserve_port() as port:
            runs[which] = run_workers(_evaluate_on_rank0, 2, args=(port, which), init=False,
                                      timeout_s=90)
    return runs


def test_rank0_evaluating_alone_finishes_and_matches_torch(evaluated):
    for rank in range(2):
        ours, theirs = evaluated["ours"][rank], evaluated["torch"][rank]
        for name in ("state", "evals"):
            assert len(ours[name]) == len(theirs[name])
            for a, b in zip(ours[name], theirs[name], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(evaluated["ours"][0]["evals"]) == 8 and not evaluated["ours"][1]["evals"]


def test_a_hang_in_a_plain_torch_script_is_named_by_the_documented_watchdog():
    # ringtrain's DDP starts no watchdog itself (docs/fault_tolerance.md says why); the script
    # wraps its loop in ringtrain.Watchdog(timeout_s=3), which works on a group torch started.
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "scripts" / "ddp_plain_torch_hang.py")],
        capture_output=True, text=True, timeout=150, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 1 hangs: it has not entered collective" in out, out
    assert "time.sleep(1000)" in out, out  # where it is stuck
    assert took < 100, f"named after {took:.0f} s; the group's collective timeout is 120 s"
