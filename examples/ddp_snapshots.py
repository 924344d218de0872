"""A plain DDP script that snapshots its state and, started again, resumes where it stopped.

    ringtrain run --nproc-per-node 2 --max-restarts 3 examples/ddp_snapshots.py --run-dir ckpt

examples/ddp_train.py with `ringtrain.SnapshotManager`: every `--snapshot-every` steps every
rank calls `save` at the same step; a thread writes the files, checksums, fsyncs and commits them
(`COMMITTED` last) while training goes on. A crash, a kill or a full disk during a write leaves
the previous snapshot the newest. At start the newest committed snapshot that verifies is
loaded: model, optimizer, the sampler's place in its epoch and the step, so a restarted job, or
the same command run again with more --steps, ends with the weights an uninterrupted run ends
with. On another number of processes it resumes too (the sampler re-splits the rest of its
epoch; keep the global batch with --batch-size). A SIGTERM (SIGINT, SIGUSR1) to the launcher
or to any rank makes every rank save the same step and exit with 143. Rank 0 prints
`param_sha256 <hex>` of the final weights.
"""

from __future__ import annotations

import argparse
import sys

import torch
from ddp_train import make_data  # the script beside this one
from torch import nn
from torch.utils.data import DataLoader

import ringtrain
from ringtrain.training.config import param_sha256


def train(run_dir: str, steps: int = 40, every: int = 10, batch_size: int = 8,
          seed: int = 0) -> str:
    """Train to `steps` SGD steps from the newest snapshot in `run_dir` (or from scratch)."""
    rt = ringtrain.init_distributed()
    torch.set_num_threads(1)  # a few ranks share a small machine's cores
    torch.manual_seed(seed)
    model = ringtrain.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(rt.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = make_data(seed=seed)
    sampler = ringtrain.DistributedSampler(data, seed=seed)
    snapshots = ringtrain.SnapshotManager(run_dir, keep=2, background=True)  # the group's ranks
    step = 0
    snap = snapshots.latest()  # the same choice on every rank (every rank verifies the files)
    if snap is not None:
        shared, _, _ = snapshots.load(snap, map_location=rt.device)
        model.module.load_state_dict(shared["model"])  # saved unwrapped: no "module." prefix
        optimizer.load_state_dict(shared["optimizer"])
        sampler.load_state_dict(shared["sampler"])  # the rest of its epoch, re-split if need be
        step = snap.step
        if rt.rank == 0:
            print(f"resumed from {snap.path} (step {step})", flush=True)

    def save() -> None:  # every rank, at the same step
        snapshots.save(step, shared={"model": model.module.state_dict(),
                                     "optimizer": optimizer.state_dict(),
                                     "sampler": sampler.state_dict()})

    # SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C) or SIGUSR1 on any rank: every rank
    # saves the same step and exits with 143, which `ringtrain run` passes on.
    with ringtrain.StopSignal() as stop:
        while step < steps:
            for x, y in DataLoader(data, batch_size=batch_size, sampler=sampler):
                x, y = x.to(rt.device), y.to(rt.device)
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if stop.agreed():  # one all-reduce of one int: the same answer on every rank
                    save()
                    snapshots.close()
                    if rt.rank == 0:
                        print(f"stopped at step {step} on a signal; saved", flush=True)
                    ringtrain.destroy_distributed()
                    sys.exit(143)
                if step % every == 0 or step == steps:
                    save()
                if step == steps:
                    break
    snapshots.close()  # the last write committed (or its error raised), on every rank
    digest = param_sha256(model.module.state_dict())
    if rt.rank == 0:
        print(f"param_sha256 {digest} (world_size {rt.world_size}, step {step})", flush=True)
    ringtrain.destroy_distributed()
    return digest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="where the snapshots go (every rank sees it)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    train(a.run_dir, a.steps, a.snapshot_every, a.batch_size, a.seed)


if __name__ == "__main__":
    main()
