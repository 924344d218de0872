"""Pipeline bubble and activation memory of each schedule on real compute, M in {2, 4, 8}.

    .venv/bin/python benchmarks/pipeline.py            # GPipe vs 1F1B, pp=2: ~3.5 min
    .venv/bin/python benchmarks/pipeline.py --quick    # one launch, ~1 min
    .venv/bin/python benchmarks/pipeline.py --schedules gpipe,1f1b,zb-h1,interleaved:2,zb-v \
        --microbatches 4,8 --model gpt                  # every schedule on the GPT
(`benchmarks/pipeline_sleep.py` measures the same with sleep-model stages, on a busy machine.)

Two gloo ranks (one thread each; `--pp` more) run a stack of wide Linear-ReLU layers (or, with
`--model gpt`, our GPT) split into equal stages, pp x v of them for `interleaved:v` (wide and
deep per stage, so that compute dwarfs the activation transfers: under 1F1B with 2 stages each
transfer is on the critical path). Every micro-batch has the same size, so the work per step
grows with M and GPipe's analysis applies: bubble = (p-1)/(M+p-1) for GPipe and 1F1B
(`ringtrain.pipeline.schedule.bubble_formula` for the others; it assumes F = B = W, and a
Linear's backward is two matmuls to its forward's one, so real stages come close).

- Measured bubble: 1 - (sum over stages of forward+backward compute time) / (stages x wall
  time of the step), the step's wall time running from the first stage's start to the last
  stage's end (`time.perf_counter` is one system-wide monotonic clock on Linux). The six
  settings take turns step by step. Per launch (a fresh pair of processes): the median over
  the undisturbed steps (wall time within 10% of the fastest step of that setting); reported:
  the median over launches.
- Peak activation bytes: per stage, the most bytes autograd held for backward at once
  (`saved_tensors_hooks`; a tensor saved twice counts once, parameters not at all), in a
  separate step so that the hooks do not disturb the timing. The JSON reports the larger of
  the two stages.

Timing needs a quiet machine: other processes on the 2 cores stretch some steps and not
others. The header line prints the load average.

The bubble depends on the micro-batch size, not only on M: every activation transfer has a
fixed cost that GPipe's formula leaves out. With 256 samples per micro-batch (the default) the
measured bubble is within 1.00-1.06x of theory for M >= 4; with 64 it was 1.08-1.23x.

The last line printed is JSON: {"results": [{"schedule", "microbatches", "bubble",
"bubble_theory", "peak_activation_bytes"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ringtrain.grid import Grid, create_pp_grad_groups, create_process_groups  # noqa: E402
from ringtrain.models import GPT, GPTConfig  # noqa: E402
from ringtrain.models import loss_fn as gpt_loss  # noqa: E402
from ringtrain.pipeline import PipelineStage, partition  # noqa: E402
from ringtrain.pipeline.schedule import bubble_formula, placement  # noqa: E402
from ringtrain.testing import run_workers  # noqa: E402

_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_TOP_PAD_": str(256 << 20),
               "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}  # 32 MiB: glibc's largest on 64-bit


class Scale(nn.Module):
    """x * w: a cheap first layer with a parameter, so that the first Linear's input needs a
    gradient and stage 0's backward does the same matmuls as stage 1's. Without it stage 0
    skips one matmul per micro-batch, the stages are unequal and the measured bubble would
    mix imbalance into the schedule's own idle time."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = [Scale(width)]
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _gpt(width: int, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=8, n_embd=width))


def _bubble(
    engine: PipelineStage, x: torch.Tensor, y: torch.Tensor, m: int, group
) -> tuple[float, float]:
    """One step: (1 - compute time of all stages / (stages x the step's wall time), wall time)."""
    engine.module.zero_grad(set_to_none=True)
    dist.barrier(group=group)
    stats = engine.train_step(x, y, m)
    mine = torch.tensor([stats.start, stats.end, stats.busy_s], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(engine.pp)]
    dist.all_gather(every, mine, group=group)
    wall = max(float(t[1]) for t in every) - min(float(t[0]) for t in every)
    return 1.0 - sum(float(t[2]) for t in every) / (engine.pp * wall), wall


def _clean_median(samples: list[tuple[float, float]]) -> tuple[float, int]:
    """Median bubble of the undisturbed steps: those within 10% of the fastest step's wall
    time. Another process taking a core only ever adds time, and it stretches one stage and
    not the other, so a disturbed step says little about the schedule."""
    fastest = min(wall for _, wall in samples)
    clean = [b for b, wall in samples if wall <= 1.1 * fastest]
    return statistics.median(clean), len(clean)


def _peak_bytes(
    engine: PipelineStage, x: torch.Tensor, y: torch.Tensor, m: int, group
) -> list[int]:
    """Peak activation bytes per stage, in a step of its own (the hooks cost a little time)."""
    engine.measure_memory = True
    engine.module.zero_grad(set_to_none=True)
    peak = engine.train_step(x, y, m).peak_activation_bytes
    engine.measure_memory = False
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(engine.pp)]
    dist.all_gather(peaks, torch.tensor([peak]), group=group)
    return [int(p) for p in peaks]


def _settings(text: str) -> list[tuple[str, int]]:
    """'gpipe,interleaved:2' -> [('gpipe', 1), ('interleaved', 2)]."""
    return [(part.split(":")[0], int(part.split(":")[1]) if ":" in part else 1)
            for part in text.split(",")]


def _worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    pp = world_size
    grid = Grid(world_size, pp=pp)
    g = create_process_groups(grid)
    grad_group = create_pp_grad_groups(grid)  # as `--strategy pipeline` on gloo
    gpt = cfg["model"] == "gpt"
    runs = {}  # (schedule, v, M) -> (engine, x, y)
    for name, v in _settings(cfg["schedules"]):
        model = _gpt(cfg["width"], cfg["layers"]) if gpt else _model(cfg["width"], cfg["layers"])
        place = placement(name, pp, v)  # zb-v: 2 chunks in a V
        v = place.v
        # equal stages: the Linears (the blocks) have the same size
        stages = partition(model.to_sequential() if gpt else model, pp * v)
        chunks = [stages[place.stage(g.pp_rank, c)] for c in range(v)]
        for m in cfg["microbatches"]:
            gen = torch.Generator().manual_seed(m)
            if gpt:
                x = torch.randint(0, 256, (m * cfg["mb_size"], 64), generator=gen)
                y = torch.randint(0, 256, (m * cfg["mb_size"], 64), generator=gen)
            else:
                x = torch.randn(m * cfg["mb_size"], cfg["width"], generator=gen)
                y = torch.randn(m * cfg["mb_size"], cfg["width"], generator=gen)
            engine = PipelineStage(chunks if v > 1 else chunks[0], pp_rank=g.pp_rank, pp=pp,
                                   pp_ranks=g.pp_ranks, pp_group=g.pp_group,
                                   grad_group=grad_group,
                                   loss_fn=gpt_loss if gpt else nn.functional.mse_loss,
                                   schedule=name)
            runs[(name, v, m)] = (engine, x, y)
    bubbles: dict[tuple, list[tuple[float, float]]] = {key: [] for key in runs}
    # Round-robin over every setting, step by step, so that a burst of load from other
    # processes hits all settings alike instead of skewing one.
    for rep in range(cfg["warmup"] + cfg["repeats"]):
        for key, (engine, x, y) in runs.items():
            sample = _bubble(engine, x, y, key[2], g.pp_group)
            if rep >= cfg["warmup"]:
                bubbles[key].append(sample)
    rows = []
    for (name, v, m), (engine, x, y) in runs.items():
        peaks = _peak_bytes(engine, x, y, m, g.pp_group)
        samples = bubbles[(name, v, m)]
        bubble, clean = _clean_median(samples)
        rows.append({
            "schedule": name, "virtual_stages": v, "microbatches": m, "bubble": bubble,
            "clean_steps": clean,
            "bubble_all_median": statistics.median(b for b, _ in samples),
            "step_ms": 1e3 * min(wall for _, wall in samples),
            "bubble_theory": bubble_formula(name, pp, m, v),
            "peak_activation_bytes_per_stage": peaks,
            "peak_activation_bytes": max(peaks),
        })
    return rows


def _combine(launches: list[list[dict]]) -> list[dict]:
    """One row per setting: the median over launches of each launch's bubble."""
    rows = []
    for per_launch in zip(*launches, strict=True):
        first = per_launch[0]
        rows.append({**first, "bubble": statistics.median(r["bubble"] for r in per_launch),
                     "launch_bubbles": [r["bubble"] for r in per_launch],
                     "step_ms": min(r["step_ms"] for r in per_launch)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="ranks (processes), one stage each")
    parser.add_argument("--schedules", default="gpipe,1f1b",
                        help="comma-separated; interleaved:v for v chunks per rank")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated M values")
    parser.add_argument("--model", choices=["linear", "gpt"], default="linear")
    parser.add_argument("--width", type=int, default=2048, help="Linear width (GPT: n_embd)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers in all (split in 2)")
    parser.add_argument("--mb-size", type=int, default=256, help="samples per micro-batch")
    parser.add_argument("--launches", type=int, default=3,
                        help="independent pairs of processes; the result is their median")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per setting and launch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 launch, 3 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.launches, args.repeats = 1, 3
    cfg = {"width": args.width, "layers": args.layers, "mb_size": args.mb_size,
           "repeats": args.repeats, "warmup": args.warmup, "model": args.model,
           "schedules": args.schedules,
           "microbatches": [int(m) for m in args.microbatches.split(",")]}
    # glibc's malloc returns large freed blocks to the OS and maps them again on the next
    # allocation, with fresh page faults: milliseconds of jitter per step that change from step
    # to step and would show up as bubble. Keep freed memory instead; the workers inherit this
    # environment when they start (it has no effect on another libc).
    for name, value in _MALLOC_ENV.items():
        os.environ.setdefault(name, value)
    # Each launch is a fresh pair of processes: on a shared VM one launch's two ranks can run a
    # few % apart in speed for its whole life (an unequal pipeline), so take the median of several.
    launches = [run_workers(_worker, args.pp, args=(cfg,), timeout_s=900)[0]
                for _ in range(args.launches)]
    rows = _combine(launches)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    model = (f"GPT n_layer={args.layers} n_embd={args.width}" if args.model == "gpt"
             else f"{args.layers} x Linear({args.width}) + ReLU")
    print(f"pp={args.pp}, {model}, {args.mb_size} samples per "
          f"micro-batch, 1 thread per rank; {args.launches} launches x {args.repeats} steps per "
          f"setting; load average {load:.2f} on {os.cpu_count()} cores")
    print(f"{'schedule':>13} {'M':>3} {'bubble':>7} {'theory':>7} {'ratio':>6} "
          f"{'per launch':>22} {'step ms':>8} {'peak activation bytes per stage':>32}")
    for r in rows:
        per_stage = " / ".join(f"{b / 2**20:.1f} MiB" for b in r["peak_activation_bytes_per_stage"])
        each = " ".join(f"{b:.3f}" for b in r["launch_bubbles"])
        label = r["schedule"] + (f":{r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        print(f"{label:>13} {r['microbatches']:>3} {r['bubble']:>7.3f} "
              f"{r['bubble_theory']:>7.3f} {r['bubble'] / r['bubble_theory']:>6.2f} {each:>22} "
              f"{r['step_ms']:>8.0f} {per_stage:>32}")
    print("bubble: median over launches of each launch's median over its undisturbed steps (wall "
          "time within 10% of its fastest); ratio: bubble / theory")
    ratios = [r["bubble"] / r["bubble_theory"] for r in rows if r["microbatches"] >= 4]
    within = "n/a" if not ratios else "yes" if all(abs(q - 1) <= 0.10 for q in ratios) else "NO"
    print(f"M >= 4 within 10% of theory: {within}")
    keys = ("schedule", "virtual_stages", "microbatches", "bubble", "bubble_theory", "step_ms",
            "peak_activation_bytes")
    print(json.dumps({"results": [{k: r[k] for k in keys} for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
