"""A plain torch script (no ringtrain launch) where rank 1 hangs while rank 0 waits in DDP's
backward all-reduce; `ringtrain.Watchdog` around the loop names it within its bound.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/scripts/ddp_plain_torch_hang.py

ringtrain's DistributedDataParallel does not start a watchdog by itself (docs/fault_tolerance.md,
"Hangs in scripts that start the group themselves"); this is the documented way to get one.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import ringtrain

dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # torch's own init, no ringtrain
rank = dist.get_rank()
model = ringtrain.DistributedDataParallel(nn.Linear(4, 4))
with ringtrain.Watchdog(timeout_s=3, interval_s=0.5):
    for step in range(3):
        if rank == 1 and step == 2:
            time.sleep(1000)  # the hang
        model(torch.ones(2, 4)).sum().backward()
dist.destroy_process_group()
