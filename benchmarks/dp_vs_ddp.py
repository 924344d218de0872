"""DataParallel against DistributedDataParallel, measured: one process, threads, processes.

    .venv/bin/python benchmarks/dp_vs_ddp.py             # GPT and MLP, ~45 s on 2 quiet cores
    .venv/bin/python benchmarks/dp_vs_ddp.py --quick     # fewer rounds, ~30 s
    .venv/bin/python benchmarks/dp_vs_ddp.py --small     # tiny models, a few seconds (the test)

The same model, initial weights and global batch, trained three ways in one run:

- `single`: one process, one thread, the whole batch: the anchor.
- `dp`: what `torch.nn.DataParallel` does every step, with 2 replicas. torch's own DataParallel
  needs CUDA devices: on CPU it has no `device_ids` and just calls the module, and the pieces
  it is made of (`replicate`, `scatter`, `parallel_apply`) refuse CPU devices. So this is a
  re-enactment of its steps on CPU, labelled `cpu-reenactment` in the output: scatter the batch;
  replicate the module (a `copy.deepcopy` stands in for the broadcast of the weights to each
  extra device, done again every step, as DataParallel does); run each replica's forward in its
  own thread (as `parallel_apply`); gather the outputs on the master and take the loss there;
  backward, each replica's part in its own thread (as autograd runs each GPU's part on that
  device's thread); reduce-add the replicas' gradients into the master's (the broadcast's
  backward); one optimizer step on the master. One process: its threads share the GIL.
- `ddp`: `ringtrain.DistributedDataParallel`, one process per replica (2 gloo ranks, 1 thread
  each), each on its half of the batch. Replicated once, when it is built (a broadcast of rank
  0's weights); every step all-reduces the gradients.

All three run inside the 2 ranks of one `run_workers` job: rank 0 runs `single` and `dp` while
rank 1 waits in a barrier (blocked, not spinning), both run `ddp`; the order rotates every
round, and the figures are medians over rounds. Each thread of `dp` records its wall time and
its CPU time (`time.thread_time`); `dp_thread_wait_share` = 1 - CPU / wall summed over threads:
the share of time the threads could not run, waiting for the GIL, or for a core if the machine
is busy: `single_thread_wait_share`, the same figure for the lone thread of `single`, is that
second part alone. All three take one SGD step from the same weights first, and their
parameters are compared (`max_abs_diff`, `same_params`: allclose). Paired ratios
(`*_vs_single_paired`) are medians of per-round ratios, steadier on a busy machine.

The last line printed is JSON: {"results": [{"model", "single_ms", "dp_ms", "ddp_ms",
"dp_replicate_ms", "dp_thread_wait_share", ...}, ...], "loadavg_before", "loadavg_after", ...}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import threading
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.models.mlp import residual_mlp
from ringtrain.testing import run_workers

REPLICAS = 2
LR = 0.01
# The dp way is always the CPU re-enactment: the three ways must run on the same cores to be
# compared. torch.nn.DataParallel itself needs 2 CUDA devices, and DDP then NCCL (not here).
DP_IMPL = "cpu-reenactment"
# Models: the `make demo` GPT on 2-digit addition (many small ops: Python and the GIL dominate)
# and a wide MLP (a few large matmuls: the weights to copy dominate). `--small`: the test's.
MODELS = {
    "gpt": {"n_layer": 2, "n_embd": 64, "batch": 128},
    "mlp": {"blocks": 4, "dim": 512, "hidden": 2048, "batch": 256},
}
SMALL = {
    "gpt": {"n_layer": 1, "n_embd": 32, "batch": 16},
    "mlp": {"blocks": 1, "dim": 32, "hidden": 64, "batch": 16},
}


def build(name: str, size: dict):
    """(model, x, y, loss_fn) for the global batch, the same on every call."""
    torch.manual_seed(0)
    if name == "gpt":
        from ringtrain.data.addition import AdditionDataset
        from ringtrain.models import GPT, GPTConfig, loss_fn

        data = AdditionDataset("train", 2)
        model = GPT(GPTConfig(vocab_size=10, block_size=data.block_size, n_layer=size["n_layer"],
                              n_embd=size["n_embd"]))
        # Every sum has the same number of answer tokens, so the mean over the batch is the
        # mean of the halves' means: the three ways compute the same gradient.
        return model, data.x[: size["batch"]], data.y[: size["batch"]], loss_fn
    model = residual_mlp(size["blocks"], size["dim"], size["hidden"], seed=None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size["batch"], size["dim"], generator=g)
    return model, x, torch.randn(size["batch"], size["dim"], generator=g), nn.functional.mse_loss


# ---- the three ways, one step each ------------------------------------------------------------


def single_step(model, opt, x, y, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    opt.step()


def _in_threads(fns) -> tuple[list, list[tuple[float, float]]]:
    """Run each fn in its own new thread (as `parallel_apply` does); results and each thread's
    (wall s, CPU s)."""
    results: list = [None] * len(fns)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(e)
        times[i] = (time.perf_counter() - t0, time.thread_time() - c0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, times


def dp_step(model, opt, x, y, loss_fn, stats: dict) -> None:
    """One step of torch.nn.DataParallel's work, re-enacted on CPU (see the module docstring)."""
    opt.zero_grad(set_to_none=True)
    xs = x.chunk(REPLICAS)  # scatter
    t0 = time.perf_counter()
    # replicate: every step, because the master's weights changed at the last step. Device 0's
    # replica is the master itself (a broadcast leaves the source's copy in place).
    replicas = [model] + [copy.deepcopy(model) for _ in range(REPLICAS - 1)]
    stats["replicate_s"] += time.perf_counter() - t0
    outs, fwd = _in_threads([lambda m=m, xi=xi: m(xi) for m, xi in zip(replicas, xs, strict=True)])
    gathered = torch.cat([o.detach() for o in outs]).requires_grad_()  # gather on the master
    loss_fn(gathered, y).backward()  # the loss over the whole batch, on the master
    grads = gathered.grad.chunk(REPLICAS)  # the gather's backward: each replica's share
    _, bwd = _in_threads([lambda o=o, g=g: o.backward(g) for o, g in zip(outs, grads, strict=True)])
    t0 = time.perf_counter()
    with torch.no_grad():  # reduce-add into the master: the broadcast's backward
        for replica in replicas[1:]:
            for p, q in zip(model.parameters(), replica.parameters(), strict=True):
                if q.grad is not None:
                    p.grad = q.grad.clone() if p.grad is None else p.grad.add_(q.grad)
    stats["reduce_s"] += time.perf_counter() - t0
    opt.step()
    for wall, cpu in fwd + bwd:
        stats["thread_wall_s"] += wall
        stats["thread_cpu_s"] += cpu


def ddp_step(ddp, opt, x, y, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn(ddp(x), y).backward()  # the gradients are averaged over the ranks in backward
    opt.step()


# ---- the run ------------------------------------------------------------------------------------


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _timed_run(fn, steps: int) -> tuple[float, float]:
    """(wall s, this thread's CPU s) per step."""
    dist.barrier()  # rank 1 waits here while rank 0 runs single and dp
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        fn()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    dist.barrier()
    return wall / steps, cpu / steps


def _bench(rank: int, world_size: int, cfg: dict) -> dict:
    out = {}
    for name in cfg["models"]:
        size = cfg["sizes"][name]
        built = {way: build(name, size) for way in ("single", "dp", "ddp")}
        x, y, loss_fn = built["single"][1:]
        half = x.shape[0] // world_size
        xr, yr = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        t0 = time.perf_counter()
        ddp = DistributedDataParallel(built["ddp"][0])  # replicated once: rank 0's weights to all
        replicate_once_s = time.perf_counter() - t0
        opts = {way: torch.optim.SGD(built[way][0].parameters(), lr=LR) for way in built}
        dp_stats = dict.fromkeys(("replicate_s", "reduce_s", "thread_wall_s", "thread_cpu_s"), 0.0)
        steps = {
            "single": partial(single_step, built["single"][0], opts["single"], x, y, loss_fn),
            "dp": partial(dp_step, built["dp"][0], opts["dp"], x, y, loss_fn, dp_stats),
            "ddp": partial(ddp_step, ddp, opts["ddp"], xr, yr, loss_fn),
        }
        # One step of each from the same weights: the three must agree.
        for way, step in steps.items():
            if way == "ddp" or rank == 0:
                step()
        after = {way: _params(built[way][0]) for way in built}  # compared on rank 0, which ran all
        diff = {way: max(float((a - b).abs().max())
                         for a, b in zip(after[way], after["single"], strict=True))
                for way in ("dp", "ddp")}
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for way in ("dp", "ddp")
                   for a, b in zip(after[way], after["single"], strict=True))
        for _ in range(cfg["warmup"]):
            for way, step in steps.items():
                if way == "ddp" or rank == 0:
                    step()
        times: dict[str, list[tuple[float, float]]] = {way: [] for way in steps}
        rounds = []
        order = list(steps)
        for r in range(cfg["rounds"]):
            for key in dp_stats:
                dp_stats[key] = 0.0
            for way in order[r % 3:] + order[:r % 3]:
                local = way == "ddp" or rank == 0
                times[way].append(_timed_run(steps[way] if local else (lambda: None),
                                             cfg["steps"] if local else 1))
            rounds.append(dict(dp_stats))
        out[name] = {"times": times, "rounds": rounds, "diff": diff, "same": same,
                     "replicate_once_s": replicate_once_s,
                     "params": sum(p.numel() for p in built["single"][0].parameters()),
                     "batch": x.shape[0]}
    return out


def _summarise(name: str, r0: dict, r1: dict, steps: int) -> dict:
    wall = {way: [w for w, _ in r0["times"][way]] for way in ("single", "dp")}
    # DDP's step is the slower rank's.
    wall["ddp"] = [max(a[0], b[0])
                   for a, b in zip(r0["times"]["ddp"], r1["times"]["ddp"], strict=True)]
    med = {way: statistics.median(t) * 1e3 for way, t in wall.items()}
    # Paired: each round's ratio compares runs made back to back, so a burst of load from other
    # processes shifts both sides; the median of those is the steadier figure.
    paired = {way: statistics.median(a / b for a, b in zip(wall[way], wall["single"], strict=True))
              for way in ("dp", "ddp")}
    # The reference for the threads' wait: one thread alone (the single way) also loses time
    # to other processes on a busy machine, though never to the GIL.
    # CPU clocks tick coarser than the wall clock: a thread that never waited can read a hair
    # more CPU than wall time, hence the floor at 0.
    alone = statistics.median(max(0.0, 1 - c / w) for w, c in r0["times"]["single"])
    per_step = [{k: v / steps for k, v in rnd.items()} for rnd in r0["rounds"]]
    wait = [max(0.0, 1 - rnd["thread_cpu_s"] / rnd["thread_wall_s"]) for rnd in per_step
            if rnd["thread_wall_s"]]
    ms = {key: round(statistics.median(s[key] for s in per_step) * 1e3, 3)
          for key in ("replicate_s", "reduce_s", "thread_cpu_s", "thread_wall_s")}
    return {
        "model": name, "params": r0["params"], "global_batch": r0["batch"], "replicas": REPLICAS,
        "dp_impl": DP_IMPL,
        "single_ms": round(med["single"], 3), "dp_ms": round(med["dp"], 3),
        "ddp_ms": round(med["ddp"], 3),
        "dp_vs_single": round(med["dp"] / med["single"], 3),
        "ddp_vs_single": round(med["ddp"] / med["single"], 3),
        "dp_vs_single_paired": round(paired["dp"], 3),
        "ddp_vs_single_paired": round(paired["ddp"], 3),
        "dp_replicate_ms": ms["replicate_s"], "dp_reduce_ms": ms["reduce_s"],
        "dp_thread_wait_share": round(statistics.median(wait), 3),
        "single_thread_wait_share": round(alone, 3),
        # Per step, summed over the replica threads of both phases (forward, backward).
        "dp_thread_cpu_ms": ms["thread_cpu_s"], "dp_thread_wall_ms": ms["thread_wall_s"],
        "ddp_replicate_once_ms": round(
            max(r0["replicate_once_s"], r1["replicate_once_s"]) * 1e3, 3
        ),
        "max_abs_diff": {way: r0["diff"][way] for way in ("dp", "ddp")},
        "same_params": bool(r0["same"]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp (default: both)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="rounds=5")
    ap.add_argument("--small", action="store_true", help="tiny models, rounds=2 steps=2 warmup=1")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"--models {args.models}: unknown {unknown}; choose from {sorted(MODELS)}")
    if args.quick:
        args.rounds = 5
    if args.small:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    cfg = {"models": models, "sizes": SMALL if args.small else MODELS, "rounds": args.rounds,
           "steps": args.steps, "warmup": args.warmup}
    load_before = os.getloadavg()
    t0 = time.time()
    per_rank = run_workers(_bench, REPLICAS, args=(cfg,), timeout_s=1800, threads=1)
    wall = time.time() - t0
    results = [_summarise(name, per_rank[0][name], per_rank[1][name], args.steps)
               for name in models]
    print(f"dp is {DP_IMPL}; {REPLICAS} replicas; "
          f"medians over {args.rounds} rounds of {args.steps} steps")
    print(f"{'model':<6}{'params':>10}{'single ms':>11}{'dp ms':>9}{'ddp ms':>9}"
          f"{'dp replicate':>14}{'threads wait: dp':>18}{'alone':>7}{'same params':>13}")
    for r in results:
        print(f"{r['model']:<6}{r['params']:>10,}{r['single_ms']:>11.2f}{r['dp_ms']:>9.2f}"
              f"{r['ddp_ms']:>9.2f}{r['dp_replicate_ms']:>11.2f} ms"
              f"{r['dp_thread_wait_share']:>17.0%}"
              f"{r['single_thread_wait_share']:>7.0%}{str(r['same_params']):>13}")
    result = {"results": results, "rounds": args.rounds, "steps": args.steps,
              "loadavg_before": [round(v, 2) for v in load_before],
              "loadavg_after": [round(v, 2) for v in os.getloadavg()], "wall_s": round(wall, 1)}
    print(f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
