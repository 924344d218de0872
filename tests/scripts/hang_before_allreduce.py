"""Rank 1 hangs (a sleep) before an all_reduce that rank 0 waits in.

    ringtrain run --nproc-per-node 2 --watchdog-timeout 5 tests/scripts/hang_before_allreduce.py
"""

import time

import torch
import torch.distributed as dist

import ringtrain

rt = ringtrain.init_distributed()
t = torch.ones(3)
for _ in range(3):
    dist.all_reduce(t)
if rt.rank == 1:
    time.sleep(1000)  # the hang
dist.all_reduce(t)
ringtrain.destroy_distributed()
