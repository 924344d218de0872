"""Pipeline schedules' bubbles with sleep-model stages: measured against each formula.

    .venv/bin/python benchmarks/pipeline_sleep.py              # pp=4, m=8: ~1 min
    .venv/bin/python benchmarks/pipeline_sleep.py --pp 4 --microbatches 16 --unit-ms 10

Every stage's compute is a fixed sleep: a forward sleeps F, an input-gradient pass B and a
weight-gradient pass W (a whole `Backward` both), F = B = W = `--unit-ms` per full stage and
1/v of that per chunk of an interleaved or zb-v schedule (zb-v: v = 2, placed in a V).
Sleeping ranks leave the CPU to the others, so 4 ranks on 2 shared cores measure the schedule,
not the machine (the real-model numbers come from `benchmarks/pipeline.py` on a quiet
machine). Activations are small tensors: their transfers cost well under a ms against the
units' tens.

The first stage has no input gradient to compute (its input is data): there its W sleeps
B + W, so every schedule does the same work per micro-batch on every stage, as a real first
stage does (its whole backward is weight gradients).

- Measured bubble: 1 - (sum over ranks of compute time) / (ranks x wall time of the step),
  the median over `--repeats` steps; formula: `ringtrain.pipeline.schedule.bubble_formula`.
- Peak activation bytes: per rank, the most bytes autograd held for backward at once
  (`saved_tensors_hooks`), the largest rank's; a split backward holds a micro-batch's
  activations until its weight gradient.

The last line printed is JSON: {"results": [{"schedule", "virtual_stages", "bubble",
"bubble_formula", "step_ms", "peak_activation_bytes"}, ...]}.
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
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ringtrain.grid import Grid, create_pp_grad_groups, create_process_groups  # noqa: E402
from ringtrain.pipeline import PipelineStage  # noqa: E402
from ringtrain.pipeline.schedule import bubble_formula  # noqa: E402
from ringtrain.testing import run_workers  # noqa: E402

SETTINGS = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4),
            ("zb-v", 2)]


class _SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps `seconds` (a pass of fixed cost)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """out = sleepB(x) * sleepW(w): the input gradient runs only x's branch (B), the weight
    gradient only w's (W), a whole backward both; the forward sleeps F.

    Args:
        f, b, w: seconds of each pass.
        first: the pipeline's first stage (its input needs no gradient: B moves into W).
    """

    def __init__(self, f: float, b: float, w: float, first: bool, width: int):
        super().__init__()
        self.f, self.b, self.w, self.first = f, b, w, first
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.f)
        weight_pass = self.w + (self.b if self.first else 0.0)
        inp = x if self.first else _SleepInBackward.apply(x, self.b)
        return inp * _SleepInBackward.apply(self.weight, weight_pass)


def _step(engine: PipelineStage, x, y, m: int, pp: int, group) -> tuple[float, float]:
    engine.module.zero_grad(set_to_none=True)
    dist.barrier(group=group)
    stats = engine.train_step(x, y, m)
    mine = torch.tensor([stats.start, stats.end, stats.busy_s], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(pp)]
    dist.all_gather(every, mine, group=group)
    wall = max(float(t[1]) for t in every) - min(float(t[0]) for t in every)
    return 1.0 - sum(float(t[2]) for t in every) / (pp * wall), wall


def _worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    pp, m, unit = world_size, cfg["microbatches"], cfg["unit_ms"] / 1e3
    grid = Grid(world_size, pp=pp)
    g = create_process_groups(grid)
    grad_group = create_pp_grad_groups(grid)  # as `--strategy pipeline` on gloo
    x = torch.randn(m * cfg["mb_size"], cfg["width"], generator=torch.Generator().manual_seed(0))
    rows = []
    for name, v in SETTINGS:
        chunks = [SleepStage(unit / v, unit / v, unit / v, first=(c == 0 and rank == 0),
                             width=cfg["width"]) for c in range(v)]
        engine = PipelineStage(chunks if v > 1 else chunks[0], pp_rank=g.pp_rank, pp=pp,
                               pp_ranks=g.pp_ranks, pp_group=g.pp_group, grad_group=grad_group,
                               loss_fn=lambda out, y: out.mean(), schedule=name)
        samples = [_step(engine, x, x, m, pp, g.pp_group)
                   for _ in range(cfg["warmup"] + cfg["repeats"])][cfg["warmup"]:]
        engine.measure_memory = True
        peak = engine.train_step(x, x, m).peak_activation_bytes
        peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(pp)]
        dist.all_gather(peaks, torch.tensor([peak]), group=g.pp_group)
        rows.append({
            "schedule": name, "virtual_stages": v, "pp": pp, "microbatches": m,
            "bubble": statistics.median(b for b, _ in samples),
            "bubble_formula": bubble_formula(name, pp, m, v),
            "step_ms": 1e3 * statistics.median(wall for _, wall in samples),
            "ideal_step_ms": 1e3 * 3 * unit * m,
            "peak_activation_bytes_per_stage": [int(p) for p in peaks],
            "peak_activation_bytes": max(int(p) for p in peaks),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="ranks (processes), one stage each")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit-ms", type=float, default=20.0, help="F = B = W per full stage")
    parser.add_argument("--mb-size", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=256, help="activation width")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    cfg = {"microbatches": args.microbatches, "unit_ms": args.unit_ms, "mb_size": args.mb_size,
           "width": args.width, "repeats": args.repeats, "warmup": args.warmup}
    rows = run_workers(_worker, args.pp, args=(cfg,), timeout_s=900)[0]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"sleep model: pp={args.pp}, m={args.microbatches}, F = B = W = {args.unit_ms:g} ms per "
          f"stage, {args.repeats} steps each (median); load average {load:.2f} on "
          f"{os.cpu_count()} cores")
    print(f"{'schedule':>12} {'v':>2} {'bubble':>7} {'formula':>7} {'ratio':>6} {'step ms':>8} "
          f"{'vs 1f1b':>8} {'peak activation KiB per stage':>32}")
    base = next(r["step_ms"] for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        per_stage = " / ".join(f"{b / 2**10:.0f}" for b in r["peak_activation_bytes_per_stage"])
        print(f"{r['schedule']:>12} {r['virtual_stages']:>2} {r['bubble']:>7.3f} "
              f"{r['bubble_formula']:>7.3f} {r['bubble'] / r['bubble_formula']:>6.2f} "
              f"{r['step_ms']:>8.0f} {base / r['step_ms']:>7.2f}x {per_stage:>32}")
    keys = ("schedule", "virtual_stages", "bubble", "bubble_formula", "step_ms",
            "peak_activation_bytes")
    print(json.dumps({"results": [{k: r[k] for k in keys} for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
