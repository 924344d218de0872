"""ringtrain's pipeline next to PyTorch's own (`torch.distributed.pipelining`) on the same work.

    .venv/bin/python benchmarks/pipeline_vs_torch.py            # GPT 4 x 256, M = 8 and 4
    .venv/bin/python benchmarks/pipeline_vs_torch.py --quick    # GPT 2 x 32, M = 4 (~5 s)

Is our pipeline at least as fast as the best peer's? Two ranks (gloo on the CPU, one thread
each), pp = 2, hold the same GPT cut into the same stages: ringtrain's `partition` of
`GPT.to_sequential()` (embedding + blocks | blocks + head; four stages for interleaved, rank r
holding stages r and r + 2). Both sides get deep copies of the same stage modules and read the
same batch, in the same processes:
- ours: `ringtrain.pipeline.PipelineStage`, schedule gpipe / 1f1b / interleaved (v = 2);
- torch's: `torch.distributed.pipelining.PipelineStage` under ScheduleGPipe / Schedule1F1B /
  ScheduleInterleaved1F1B (the same loop placement), the GPT's loss as the schedule's loss_fn.
A step is zero_grad, forward and backward of M micro-batches of one global batch (16
sequences), and AdamW's step. Per schedule and M, the two take turns step by step (which goes
first alternates, both ranks start each step at a barrier), so load from other processes hits
both alike. Reported: the median step (the slower rank's time, per step) after warm-up steps,
ours / torch's, the first step's loss on both, the largest loss difference over all steps (the
same weights, data and updates: the two trainings must stay together), and the largest gradient
difference after one step without an optimizer step. A table, then one JSON line, printed last.

What is not the same, and cannot be made so without changing either library:
- the 1/M of a mean over micro-batches: ours scales each micro-batch's loss before its
  backward, torch's scales the accumulated gradients afterwards (`scale_grads=True`, one more
  pass over the gradients per step). The gradients agree to rounding (exactly, for M a power of 2);
- the first step: ours learns the boundary shapes by a dry run of one micro-batch, torch's by
  exchanging metadata objects; both happen once, inside the warm-up steps;
- torch's last stage keeps the outputs of its micro-batches unless told not to; we pass
  `return_outputs=False`, as ours returns none.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import pipelining

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringtrain.grid import Grid, create_pp_grad_groups, create_process_groups  # noqa: E402
from ringtrain.models import GPT, GPTConfig, loss_fn  # noqa: E402
from ringtrain.pipeline import PipelineStage, partition  # noqa: E402
from ringtrain.pipeline.schedule import placement  # noqa: E402
from ringtrain.testing import run_workers  # noqa: E402

FULL = {"config": dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256),
        "batch": 16, "microbatches": [8, 4], "steps": 20, "warmup": 3}
QUICK = {"config": dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
         "batch": 8, "microbatches": [4], "steps": 3, "warmup": 2}
# ours -> (torch's schedule class, chunks per rank)
SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2)}
LR = 1e-3


class Sides:
    """This rank's part of one setting (schedule, M) for both implementations."""

    def __init__(self, name: str, m: int, stages: list, g, grad_group) -> None:
        torch_name, v = SCHEDULES[name]
        place = placement(name, len(g.pp_ranks), v)
        mine = [place.stage(g.pp_rank, c) for c in range(place.v)]  # virtual stages, chunk order
        self.first, self.last = 0 in mine, len(stages) - 1 in mine
        self.m = m
        self.chunks = [copy.deepcopy(stages[i]) for i in mine]
        self.ours = PipelineStage(self.chunks if v > 1 else self.chunks[0], pp_rank=g.pp_rank,
                                  pp=place.pp, pp_ranks=g.pp_ranks, pp_group=g.pp_group,
                                  grad_group=grad_group, loss_fn=loss_fn, schedule=name)
        # torch's PipelineStage has no default device: it must be told cpu. Without input_args
        # it infers the boundary shapes at the first step, sending metadata objects over
        # `group` (send_object_list with device=cpu: fine on gloo).
        self.theirs = [pipelining.PipelineStage(copy.deepcopy(stages[i]), stage_index=i,
                                                num_stages=len(stages), device=torch.device("cpu"),
                                                group=g.pp_group) for i in mine]
        # ScheduleInterleaved1F1B needs M % pp == 0 (its "rounds"); the others take any M.
        self.schedule = getattr(pipelining, torch_name)(
            self.theirs if v > 1 else self.theirs[0], n_microbatches=m, loss_fn=loss_fn)
        params = [p for c in self.chunks for p in c.parameters()]
        self.opt_ours = torch.optim.AdamW(params, lr=LR)
        self.opt_theirs = torch.optim.AdamW(
            [p for s in self.theirs for p in s.submod.parameters()], lr=LR)

    def step_ours(self, x, y, optimize: bool = True) -> float | None:
        self.opt_ours.zero_grad(set_to_none=True)
        stats = self.ours.train_step(x, y, self.m)
        if optimize:
            self.opt_ours.step()
        return stats.loss_sum / stats.count if stats.count else None

    def step_theirs(self, x, y, optimize: bool = True) -> float | None:
        self.opt_theirs.zero_grad(set_to_none=True)
        # The input goes to the first stage only, target and losses to the last only.
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*((x,) if self.first else ()), return_outputs=False, **kwargs)
        if optimize:
            self.opt_theirs.step()
        # equal micro-batches: the mean of their mean losses is the batch's mean loss
        return statistics.fmean(t.item() for t in losses) if self.last else None

    def grad_max_diff(self) -> float:
        ours = [p.grad for c in self.chunks for p in c.parameters()]
        theirs = [p.grad for s in self.theirs for p in s.submod.parameters()]
        return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def _worker(rank: int, world_size: int, size: dict) -> list[dict]:
    grid = Grid(world_size, pp=world_size)
    g = create_process_groups(grid)
    # What `--strategy pipeline` gives its stages on gloo: gradients on a group of their own.
    grad_group = create_pp_grad_groups(grid)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**size["config"]))
    vocab, block = size["config"]["vocab_size"], size["config"]["block_size"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (size["batch"], block), generator=gen)  # (B, T)
    y = torch.randint(0, vocab, (size["batch"], block), generator=gen)
    rows = []
    for name in size["schedules"]:
        stages = partition(gpt.to_sequential(), world_size * SCHEDULES[name][1])
        for m in size["microbatches"]:
            s = Sides(name, m, stages, g, grad_group)
            # One step without an update: the same weights and batch give the same gradients.
            check = {"ours": s.step_ours(x, y, optimize=False),
                     "torch": s.step_theirs(x, y, optimize=False)}
            grad_diff = s.grad_max_diff()
            runs = {"ours": s.step_ours, "torch": s.step_theirs}
            ms: dict[str, list[float]] = {k: [] for k in runs}
            losses: dict[str, list[float | None]] = {k: [check[k]] for k in runs}
            for step in range(size["warmup"] + size["steps"]):
                for side in (["ours", "torch"] if step % 2 == 0 else ["torch", "ours"]):
                    dist.barrier(group=g.pp_group)
                    t0 = time.perf_counter()
                    losses[side].append(runs[side](x, y))
                    ms[side].append(1e3 * (time.perf_counter() - t0))
            rows.append({"schedule": name, "microbatches": m, "grad_max_diff": grad_diff,
                         "losses": losses, "warmup": size["warmup"],
                         "ms": {k: t[size["warmup"]:] for k, t in ms.items()}})
    return rows


def _combine(per_rank: list[list[dict]]) -> list[dict]:
    """One row per setting: a step lasts until its slower rank is done; the loss is the last
    stage's (interleaved: rank 1 holds stage 3); the gradients differ most on some rank."""
    rows = []
    for ranks in zip(*per_rank, strict=True):
        a = ranks[0]
        step_ms = {k: [max(t) for t in zip(*(r["ms"][k] for r in ranks), strict=True)]
                   for k in ("ours", "torch")}
        ours_ms = round(statistics.median(step_ms["ours"]), 2)
        torch_ms = round(statistics.median(step_ms["torch"]), 2)
        lo = [r["losses"] for r in ranks if r["losses"]["ours"][0] is not None][0]
        rows.append({"schedule": a["schedule"], "microbatches": a["microbatches"],
                     "ours_ms": ours_ms, "torch_ms": torch_ms,
                     "ratio": round(ours_ms / torch_ms, 3),
                     "ours_ms_min": round(min(step_ms["ours"]), 2),
                     "torch_ms_min": round(min(step_ms["torch"]), 2),
                     "loss_ours": lo["ours"][0], "loss_torch": lo["torch"][0],
                     "loss_max_diff": max(abs(p - q) for p, q in zip(lo["ours"], lo["torch"],
                                                                     strict=True)),
                     "loss_last": lo["ours"][-1],
                     "grad_max_diff": max(r["grad_max_diff"] for r in ranks)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, M = 4, a few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per setting and side")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help=f"comma-separated, of {list(SCHEDULES)}")
    ap.add_argument("--microbatches", default=None, help="comma-separated M values")
    args = ap.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    size["schedules"] = args.schedules.split(",")
    unknown = [n for n in size["schedules"] if n not in SCHEDULES]
    if unknown:
        ap.error(f"--schedules {args.schedules}: unknown {unknown}; choose from {list(SCHEDULES)}")
    if args.microbatches:
        size["microbatches"] = [int(m) for m in args.microbatches.split(",")]
    bad = [m for m in size["microbatches"] if m < 2 or size["batch"] % m or m % 2]
    if bad:
        ap.error(f"--microbatches {bad}: M must be even (torch's interleaved 1F1B needs M % pp "
                 f"== 0, pp = 2) and divide the batch of {size['batch']}; try 4 or 8")
    size["steps"] = args.steps or size["steps"]
    load_before = os.getloadavg()[0]
    rows = _combine(run_workers(_worker, 2, args=(size,), timeout_s=1200))
    load_after = os.getloadavg()[0]
    print(f"GPT {size['config']}, batch {size['batch']}, pp 2 (gloo, 1 thread per rank), "
          f"{size['steps']} timed steps after {size['warmup']}, torch {torch.__version__}, "
          f"load {load_before:.2f} -> {load_after:.2f}")
    print(f"{'schedule':12} {'M':>2} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} "
          f"{'loss ours':>10} {'loss torch':>10} {'loss diff':>9} {'grad diff':>9}")
    for r in rows:
        print(f"{r['schedule']:12} {r['microbatches']:2d} {r['ours_ms']:9.1f} "
              f"{r['torch_ms']:9.1f} {r['ratio']:6.3f} {r['loss_ours']:10.6f} "
              f"{r['loss_torch']:10.6f} {r['loss_max_diff']:9.1e} {r['grad_max_diff']:9.1e}")
    print(json.dumps({"benchmark": "pipeline_vs_torch", "torch": torch.__version__, "pp": 2,
                      "threads": 1, "backend": "gloo", "config": size["config"],
                      "batch": size["batch"], "steps": size["steps"], "warmup": size["warmup"],
                      "optimizer": f"AdamW(lr={LR})", "rows": rows,
                      "load_before": round(load_before, 2), "load_after": round(load_after, 2)}))


if __name__ == "__main__":
    main()
