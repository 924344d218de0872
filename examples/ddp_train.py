"""One training script for every launcher: ringtrain's DDP and sampler on a tiny regression.

    ringtrain run --nproc-per-node 2 examples/ddp_train.py             # one machine
    srun -n 2 python examples/ddp_train.py                             # Slurm, a task per process
    torchx run -s local_cwd dist.ddp -j 1x2 --script examples/ddp_train.py
    mpirun -n 2 -x MASTER_PORT=29500 python examples/ddp_train.py      # Open MPI, one node
    python examples/ray_train.py                                       # Ray Train, 2 CPU workers

Nothing in it names a launcher: `ringtrain.init_distributed()` finds out which one started it
(docs/clusters.md). Rank 0 logs that, then prints `param_sha256 <hex>` of the final weights,
which is the same under every launcher for the same world size; `--out FILE` also writes it
there as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringtrain
from ringtrain.training.config import param_sha256


def make_data(n: int = 256, seed: int = 0) -> TensorDataset:
    """y = sin(x . w) + noise, the same on every rank (a fixed generator, not the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, generator=g)
    return TensorDataset(x, torch.sin(x @ w).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g))


def train(steps: int = 30, batch_size: int = 8, seed: int = 0, out: str | None = None) -> str:
    """Train `steps` SGD steps with a per-rank batch of `batch_size`; return the weights' digest.

    Args:
        steps: optimizer steps (the sampler starts a new epoch when one ends).
        batch_size: samples per rank per step.
        seed: initialisation and data order.
        out: rank 0 writes {"param_sha256", "world_size"} there as JSON.
    """
    rt = ringtrain.init_distributed()
    torch.set_num_threads(1)  # a few ranks share a small machine's cores
    torch.manual_seed(seed)  # the same initial weights on every rank (DDP checks, then copies)
    # On this rank's device: a GPU under NCCL (one per process), the CPU under gloo.
    model = ringtrain.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(rt.device)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = make_data(seed=seed)
    # This rank's shard, a new shuffle per epoch.
    sampler = ringtrain.DistributedSampler(data, seed=seed)
    step = 0
    while step < steps:
        for x, y in DataLoader(data, batch_size=batch_size, sampler=sampler):
            x, y = x.to(rt.device), y.to(rt.device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # gradients averaged across ranks here
            optimizer.step()
            step += 1
            if step == steps:
                break
    digest = param_sha256(model.module.state_dict())
    if rt.rank == 0:
        print(f"param_sha256 {digest} (world_size {rt.world_size}, loss {loss.item():.4f})",
              flush=True)
        if out:
            with open(out, "w") as f:
                json.dump({"param_sha256": digest, "world_size": rt.world_size}, f)
    ringtrain.destroy_distributed()  # leaves a group it did not start (Ray Train's) to its owner
    return digest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 writes the digest here (JSON)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows which launcher was found
    train(args.steps, args.batch_size, args.seed, args.out)


if __name__ == "__main__":
    main()
