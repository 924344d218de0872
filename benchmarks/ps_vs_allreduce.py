"""Parameter server (sync, async, SSP k=2) against all-reduce DDP, with and without a straggler.

    .venv/bin/python benchmarks/ps_vs_allreduce.py            # 8 runs, a few minutes
    .venv/bin/python benchmarks/ps_vs_allreduce.py --quick    # lower target, about a minute

Every run trains the default GPT on the default task (2-digit addition) with 2 workers, each on
its own process with one thread, on the same batches, optimizer (AdamW) and schedule (the
task's lr 3e-3, warmup, cosine over --steps global-batch steps), until worker 0's held-out
exact-match accuracy reaches the target or the steps run out. The PS modes add one server
process (3 processes on this 2-core machine: the realistic size here); DDP runs 2.

- samples_per_s: samples whose gradients were pushed (all workers) / wall time of the run;
- steps_to_target: global-batch steps (2 x batch samples each) behind the parameters that first
  reached the target: DDP's step count, or the gradients the servers applied / 2 for the PS
  modes; null when the target was not reached;
- time_to_target_s: steps_to_target x 2 x batch / samples_per_s, what a user waits;
- slow_worker: worker 1 sleeps, after every step, the median step time it had in the same
  mode without the sleep, so its steps take twice as long.

The last line printed is JSON: {"results": [{"mode", "slow_worker", "samples_per_s",
"steps_to_target", ...}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

WORKERS = 2
BATCH = 64
MODES = {  # name -> (strategy, options)
    "allreduce-ddp": ("ddp", {}),
    "ps-sync": ("ps", {"servers": 1, "mode": "sync"}),
    "ps-async": ("ps", {"servers": 1, "mode": "async"}),
    "ps-ssp-k2": ("ps", {"servers": 1, "mode": "ssp", "staleness": 2}),
}


def _run(rank: int, world_size: int, mode: str, delay_s: float, target: float, steps: int,
         eval_every: int) -> dict:
    """One rank of one run (a module-level function: `run_workers` spawns it)."""
    from ringtrain.data.addition import AdditionDataset, exact_match
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.runtime import get_runtime
    from ringtrain.strategies import make_strategy
    from ringtrain.strategies.ps_config import ASYNC_BETA1
    from ringtrain.training.trainer import TrainerConfig, adamw, lr_at

    rt = get_runtime()
    train, test = AdditionDataset("train"), AdditionDataset("test")
    name, options = MODES[mode]
    strategy = make_strategy(name, runtime=rt, **options)
    torch.manual_seed(1337)
    strategy.setup(GPT(GPTConfig(vocab_size=train.vocab_size, block_size=train.block_size)),
                   adamw(0.1, betas=(ASYNC_BETA1 if options.get("mode") == "async" else 0.9, 0.95)),
                   loss_fn)  # the main job's defaults (`ringtrain train --beta1`)
    schedule = TrainerConfig(steps=steps, lr=3e-3).resolved()  # the task's lr, warmup, cosine
    is_ps = name == "ps"

    def batch(step: int):
        g = torch.Generator().manual_seed(step * 97 + rank)
        idx = torch.randint(len(train), (BATCH,), generator=g)
        return train.x[idx], train.y[idx]

    def global_step(own: int) -> int:
        """Global-batch steps so far: DDP's own count; gradients applied / workers for a PS."""
        return strategy.worker.applied // WORKERS if is_ps else own

    # A server (PS, the last ranks) trains nothing: its threads serve until the workers leave.
    trains = not (is_ps and strategy.topology.is_server(rank))
    own, reached, acc, step_s = 0, None, None, []
    dist.barrier()  # start together
    start = time.monotonic()
    while trains and global_step(own) < steps:
        if is_ps and rt.store.check(["bench/stop"]):
            break
        t0 = time.perf_counter()
        strategy.train_step([batch(own)], lr=lr_at(global_step(own), schedule), grad_clip=1.0)
        step_s.append(time.perf_counter() - t0)
        own += 1
        if delay_s and rank == WORKERS - 1:
            time.sleep(delay_s)  # the straggler
        if own % eval_every:
            continue
        hit = torch.zeros(1)
        if rank == 0:
            acc = float(exact_match(strategy.eval_logits(test.x), test.y).mean())
            if acc >= target:
                hit += 1
                reached = global_step(own)
        if not is_ps:  # DDP ranks must agree on the last step: decide together
            dist.all_reduce(hit)
        elif hit.item():
            rt.store.set("bench/stop", "1")  # the other workers see it before their next step
        if hit.item():
            break
    end = time.monotonic()
    strategy.close()
    stats = strategy.stats() if not trains else {}
    return {"steps": own, "start": start, "end": end, "reached": reached, "accuracy": acc,
            "stats": stats, "step_s": statistics.median(step_s) if step_s else 0.0}


def run(mode: str, delay_s: float, args: argparse.Namespace) -> dict:
    """One run; worker 1 sleeps `delay_s` after every step (0: no straggler)."""
    from ringtrain.testing import run_workers

    world_size = WORKERS + (1 if MODES[mode][0] == "ps" else 0)
    out = run_workers(_run, world_size, args=(mode, delay_s, args.target, args.steps,
                                              args.eval_every), timeout_s=600)
    wall = max(r["end"] for r in out) - min(r["start"] for r in out)
    samples = sum(r["steps"] for r in out) * BATCH
    server = next((r["stats"] for r in out if r["stats"]), {})
    return {"mode": mode, "slow_worker": delay_s > 0, "samples_per_s": samples / wall,
            "steps_to_target": out[0]["reached"], "wall_s": wall,
            "worker_steps": [r["steps"] for r in out[:WORKERS]], "delay_ms": delay_s * 1e3,
            "step_ms": [round(r["step_s"] * 1e3, 2) for r in out[:WORKERS]],
            "last_accuracy": out[0]["accuracy"],
            "staleness_max": server.get("staleness_max"),
            "staleness_mean": server.get("staleness_mean")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="target 0.5 within 300 steps")
    p.add_argument("--target", type=float, default=None, help="held-out accuracy (default 0.9)")
    p.add_argument("--steps", type=int, default=None, help="global-batch steps at most, and the "
                   "length of the LR schedule (default 800)")
    p.add_argument("--eval-every", type=int, default=20, help="worker 0's steps between evals")
    p.add_argument("--repeats", type=int, default=1, help="runs per row; medians are reported")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                   + ", ".join(MODES))
    args = p.parse_args(argv)
    args.target = args.target or (0.5 if args.quick else 0.9)
    args.steps = args.steps or (300 if args.quick else 800)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; target accuracy "
          f"{args.target}; {WORKERS} workers x batch {BATCH} (+1 server for ps modes)", flush=True)
    rows = []
    delays: dict[str, float] = {}
    for slow in (False, True):
        for mode in args.modes.split(","):
            # The straggler sleeps one unslowed step time of its mode after each step (the
            # median from the run without it), so its step takes twice as long.
            delay = delays[mode] if slow else 0.0
            runs = [run(mode, delay, args) for _ in range(args.repeats)]
            if not slow:
                delays[mode] = statistics.median(r["step_ms"][-1] for r in runs) / 1e3
            row = dict(runs[0])
            row["samples_per_s"] = statistics.median(r["samples_per_s"] for r in runs)
            reached = [r["steps_to_target"] for r in runs if r["steps_to_target"] is not None]
            row["steps_to_target"] = statistics.median(reached) if reached else None
            # What a user waits for: the target's samples at this mode's rate.
            row["time_to_target_s"] = (
                row["steps_to_target"] * WORKERS * BATCH / row["samples_per_s"]
                if reached else None)
            rows.append(row)
            ttt = row["time_to_target_s"]
            print(f"{mode:>14} slow={str(slow):5} {row['samples_per_s']:8.0f} samples/s  "
                  f"steps_to_target {row['steps_to_target']}  time_to_target "
                  f"{'-' if ttt is None else f'{ttt:.1f} s'}  wall {row['wall_s']:.1f} s  "
                  f"worker steps {row['worker_steps']}  step ms {row['step_ms']}  sleep ms "
                  f"{row['delay_ms']:.1f}  staleness max/mean "
                  f"{row['staleness_max']}/{row['staleness_mean']}", flush=True)
    base = {r["slow_worker"]: r["samples_per_s"] for r in rows if r["mode"] == "allreduce-ddp"}
    if base:
        print("samples/s relative to all-reduce DDP in the same setting:")
        for r in rows:
            print(f"  {r['mode']:>14} slow={str(r['slow_worker']):5} "
                  f"{r['samples_per_s'] / base[r['slow_worker']]:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    print(json.dumps({"results": rows, "target_accuracy": args.target, "workers": WORKERS,
                      "batch_size": BATCH}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
