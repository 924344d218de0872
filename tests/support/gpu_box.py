"""What the CPU tests leave out on a machine where torch sees a GPU, and why.

torch's PowerSGD comm hook on CPU tensors: its `decompress` calls
`torch.cuda.synchronize(device)` with the bucket's device whenever `torch.cuda.is_available()`
(torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, torch 2.11-2.15), so on a GPU box
a CPU bucket raises "Expected a cuda device, but got: cpu" - torch's own DDP the same way (seen
on an H100 with torch 2.11). The CPU tests that run torch's hook leave it out there; a CPU
machine (CI) runs it.
"""

from __future__ import annotations

import torch

TORCH_POWERSGD_ON_CPU = not torch.cuda.is_available()
TORCH_POWERSGD_LEFT_OUT = ("torch's powerSGD_hook calls torch.cuda.synchronize() on a CPU bucket "
                           "where a GPU is visible (torch's bug; torch's DDP fails the same way)")
