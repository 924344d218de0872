"""Ray Train runs examples/ddp_train.py's `train` unchanged on 2 CPU workers of a local Ray cluster.

    pip install 'ringtrain[ray]'
    python examples/ray_train.py                        # a local Ray cluster, 2 workers, CPU
    python examples/ray_train.py --address auto         # an existing cluster (`ray start --head`)

Ray's TorchTrainer starts one worker process per `num_workers` and calls
`init_process_group` in each itself (gloo, since `use_gpu=False`) before it runs
`train_loop_per_worker`; ringtrain's `init_distributed()` inside `train` takes that group as it
is, with the device Ray gave the worker, and leaves it for Ray to destroy. ringtrain's
DistributedDataParallel and DistributedSampler then work as under any other launcher: the
final weights equal those of `ringtrain run --nproc-per-node 2 examples/ddp_train.py`.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_loop_per_worker(config: dict) -> None:
    """What each Ray worker runs: the same `train` as every other launcher's."""
    sys.path.insert(0, config["examples"])  # Ray's workers do not start in this directory
    from ddp_train import train

    train(config["steps"], config["batch_size"], config["seed"], config["out"])  # rank 0 prints


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 writes the digest here (JSON)")
    p.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    args = p.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        # A CPU of its own for each worker and one for Ray's training controller: with fewer,
        # the workers wait for resources forever on a 2-core machine. On loopback: one machine.
        ray.init(num_cpus=args.num_workers + 1, include_dashboard=False,
                 _node_ip_address="127.0.0.1")
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"steps": args.steps, "batch_size": args.batch_size,
                               "seed": args.seed, "out": args.out and os.path.abspath(args.out),
                               "examples": EXAMPLES},
            scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        )
        trainer.fit()  # raises if a worker failed
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
