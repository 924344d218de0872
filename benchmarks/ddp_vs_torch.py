"""ringtrain's DistributedDataParallel against torch's, side by side in one run.

    .venv/bin/python benchmarks/ddp_vs_torch.py                 # full: ~17M params, 2 ranks
    .venv/bin/python benchmarks/ddp_vs_torch.py --quick         # a reduced run, ~1 min

2 gloo ranks, 1 thread each. Every rank builds the same model (a stack of Linear-GELU-Linear
residual blocks, batch 32 per rank) three times from one seed: wrapped by ringtrain, by torch,
and by the naive reference. Each round times `--steps` SGD steps of each, in an order that
rotates from round to round so drift (other processes, thermal) hits all alike; the figures are
medians over rounds.

sync_efficiency = (one raw gloo all_reduce of a flat buffer holding all gradient bytes) /
(ringtrain's own gradient sync of the same gradients, no compute running: bucketing, copies,
averaging and the unused-parameter check included: `reducer.sync_gradients()` on gradients made
by a plain backward), medians over `--sync-reps` alternating repetitions. ringtrain spreads its
buckets over `comm_lanes` gloo groups (3 by default), which is why it can beat one raw
all-reduce on one group; `--lanes 1` shows the single-group figure.

`sync_efficiency_training` times the sync as a training step runs it, in two parts: a synced
backward under `reducer.defer()` stages each gradient in the reducer's hooks (averaged in place
while still hot in cache, small ones copied into their bucket) and sends nothing; that hook time
(`staging_ms`) plus the time of `reducer.flush()` (launch every bucket, wait, check, write back).
The cold figure pays the averaging as a pass over cold memory (~5 ms for 64 MiB) instead.

The last line printed is JSON: ringtrain_ms, torch_ms, ratio (ringtrain / torch step time),
sync_efficiency, their paired versions (median of per-round ratios, steadier on a busy
machine), and the rest of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.naive import NaiveDistributedDataParallel
from ringtrain.models.mlp import residual_mlp
from ringtrain.testing import run_workers


def _step(net: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, x, y, naive: bool) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(net(x), y).backward()
    if naive:
        net.sync_gradients()
    opt.step()


def _timed(fn, steps: int) -> tuple[float, float]:
    """Wall ms per step, and CPU ms per step of this process (all its threads, gloo's included)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    dist.barrier()  # the step of the slower rank counts
    return (time.perf_counter() - t0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3


def _bench(rank: int, world_size: int, cfg: dict) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    y = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    runs = {}
    for name in ("ringtrain", "torch", "naive"):
        model = residual_mlp(cfg["blocks"], cfg["dim"], cfg["hidden"])
        if name == "ringtrain":
            net = DistributedDataParallel(model, comm_lanes=cfg["lanes"])
        else:
            net = {"torch": torch.nn.parallel.DistributedDataParallel,
                   "naive": NaiveDistributedDataParallel}[name](model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        runs[name] = (net, model, opt)
    step = {name: (lambda n=name: _step(*runs[n], x, y, naive=n == "naive")) for name in runs}
    for name in runs:
        for _ in range(cfg["warmup"]):
            step[name]()
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(cfg["rounds"]):
        for name in order[r % 3:] + order[:r % 3]:
            wall_ms, cpu_ms = _timed(step[name], cfg["steps"])
            times[name].append(wall_ms)
            cpu[name].append(cpu_ms)

    # Sync path alone, against one flat all-reduce of as many bytes (see the module docstring).
    net, model, _ = runs["ringtrain"]
    reducer = net.reducer
    nn.functional.mse_loss(model(x), y).backward()  # plain module call: grads, no sync
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    raw, ours, staging, cold = [], [], [], []
    for _ in range(cfg["sync_reps"]):
        raw.append(timed(lambda: dist.all_reduce(flat)))
        model.zero_grad(set_to_none=True)
        reducer.defer()
        nn.functional.mse_loss(net(x), y).backward()  # stages in its hooks, sends nothing
        staging.append(reducer.staging_s * 1e3)
        ours.append(timed(reducer.flush) + staging[-1])
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        cold.append(timed(reducer.sync_gradients))
    return {"times": times, "cpu": cpu, "raw": raw, "ours": ours, "staging": staging, "cold": cold,
            "params": sum(p.numel() for p in model.parameters()),
            "buckets": len(net.reducer.buckets), "lanes": len(net.reducer.lanes)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sync-reps", type=int, default=20)
    ap.add_argument("--lanes", type=int, default=None,
                    help="ringtrain's comm_lanes (default: its own default, 3 on gloo)")
    ap.add_argument("--quick", action="store_true", help="rounds=3 steps=4 sync-reps=5")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sync_reps = 3, 4, 5
    cfg = vars(args)
    load_before = os.getloadavg()
    t0 = time.time()
    per_rank = run_workers(_bench, 2, args=(cfg,), timeout_s=3600, threads=1)
    wall = time.time() - t0
    # Each round's step time is the mean over ranks (barriers make them nearly equal).
    med = {name: statistics.median(statistics.mean(rk["times"][name][r] for rk in per_rank)
                                   for r in range(args.rounds))
           for name in ("ringtrain", "torch", "naive")}
    reps = {key: [max(rk[key][i] for rk in per_rank) for i in range(args.sync_reps)]
            for key in ("raw", "ours", "staging", "cold")}
    raw_reps, ours_reps = reps["raw"], reps["ours"]
    raw, ours = statistics.median(raw_reps), statistics.median(ours_reps)
    cold = statistics.median(reps["cold"])
    # Paired figures: each round (repetition) compares runs made back to back, so a burst of
    # load from other processes shifts both sides; their median is the steadier estimate.
    per_round = {name: [statistics.mean(rk["times"][name][r] for rk in per_rank)
                        for r in range(args.rounds)]
                 for name in ("ringtrain", "torch")}
    ratio_paired = statistics.median(
        a / b for a, b in zip(per_round["ringtrain"], per_round["torch"], strict=True)
    )
    efficiency_paired = statistics.median(
        a / b for a, b in zip(raw_reps, reps["cold"], strict=True)
    )
    result = {
        "ringtrain_ms": round(med["ringtrain"], 2),
        "torch_ms": round(med["torch"], 2),
        "naive_ms": round(med["naive"], 2),
        "ratio": round(med["ringtrain"] / med["torch"], 4),
        "sync_efficiency": round(raw / cold, 4),
        "ratio_paired": round(ratio_paired, 4),
        "sync_efficiency_paired": round(efficiency_paired, 4),
        "sync_efficiency_training": round(raw / ours, 4),
        # CPU time per step summed over both ranks: the work each DDP costs, which a busy
        # machine does not distort the way it distorts wall time.
        **{f"{name}_cpu_ms": round(statistics.median(sum(rk["cpu"][name][r] for rk in per_rank)
                                                     for r in range(args.rounds)), 2)
           for name in ("ringtrain", "torch", "naive")},
        "raw_allreduce_ms": round(raw, 2),
        "ringtrain_sync_ms": round(cold, 2),
        "ringtrain_sync_training_ms": round(ours, 2),
        "ringtrain_staging_ms": round(statistics.median(reps["staging"]), 2),
        "params": per_rank[0]["params"],
        "grad_mb": round(per_rank[0]["params"] * 4 / 2**20, 1),
        "buckets": per_rank[0]["buckets"], "lanes": per_rank[0]["lanes"],
        "world_size": 2, "batch_per_rank": args.batch, "rounds": args.rounds, "steps": args.steps,
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "wall_s": round(wall, 1),
    }
    print(f"{'':<12}{'step ms (median)':>18}{'vs torch':>10}{'CPU ms/step':>13}")
    for name in ("ringtrain", "torch", "naive"):
        print(f"{name:<12}{med[name]:>18.2f}{med[name] / med['torch']:>10.3f}"
              f"{result[name + '_cpu_ms']:>13.1f}")
    print(f"paired (median over rounds of the per-round ratio): ratio {ratio_paired:.3f}, "
          f"sync efficiency {efficiency_paired:.3f}")
    print(f"sync path: raw all_reduce of {result['grad_mb']} MiB {raw:.2f} ms, ringtrain sync "
          f"{cold:.2f} ms ({result['buckets']} buckets on {result['lanes']} lanes): efficiency "
          f"{raw / cold:.3f}; as in training {ours:.2f} ms ({result['ringtrain_staging_ms']:.2f} "
          f"ms of it in backward's hooks): {raw / ours:.3f}")
    print(f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
