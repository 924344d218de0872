"""Rank, world size, init_process_group: the same file runs in every process, each with its rank.

    .venv/bin/ringtrain run --nproc-per-node 2 examples/concepts/hello_ranks.py     # ~5 s

The launcher starts 2 processes and gives each one RANK (0 or 1: who am I), WORLD_SIZE (2: how
many of us), LOCAL_RANK (my index on this machine) and MASTER_ADDR:MASTER_PORT (where rank 0
keeps the store the others meet at). `ringtrain.init_distributed()` reads them and calls torch's
`init_process_group` (gloo on CPU, NCCL on GPUs). Then every rank contributes rank + 1 to one
all_reduce and every rank gets the sum: 1 + 2 = 3.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ringtrain

t0 = time.perf_counter()
rt = ringtrain.init_distributed()
init_ms = (time.perf_counter() - t0) * 1e3
x = torch.tensor([rt.rank + 1.0])
t0 = time.perf_counter()
dist.all_reduce(x)  # a collective: every rank must call it, in the same order
reduce_ms = (time.perf_counter() - t0) * 1e3
print(f"rank {rt.rank} of world_size {rt.world_size} (local_rank {rt.local_rank}, backend "
      f"{rt.backend}, store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): "
      f"init_process_group {init_ms:.0f} ms, all_reduce(rank + 1) = {x.item():g} in "
      f"{reduce_ms:.2f} ms", flush=True)
ringtrain.destroy_distributed()
