"""What a snapshot costs the step: synchronous, in the background (two writers), and none.

    .venv/bin/python benchmarks/snapshot_stall.py                 # ~100 M parameter GPT
    .venv/bin/python benchmarks/snapshot_stall.py --quick         # a small model, seconds
    .venv/bin/python benchmarks/snapshot_stall.py --every 50 --steps 300   # issue 29's shape
    .venv/bin/python benchmarks/snapshot_stall.py --strategy zero --zero-stage 3 \
        --modes none,async,async_clone      # what ZeroStrategy.updated_state() saves the step

One process (CUDA if present, else the CPU), `ringtrain.Trainer` with the `ddp` strategy on one
rank, a GPT of about 100 M parameters (14 layers, 768 wide, 12 heads: 99 M with a 65-token
vocabulary) on random tokens, AdamW. The same run (same seed, same steps) is trained three
times per round, with a snapshot every --every steps into a temporary run directory:
- `none`: no snapshots (`snapshot_every=0`);
- `sync`: the whole save in the step (`--sync-snapshots`);
- `async`: the default: buffers copied in the step, parameters and moments beside the next
  forward/backward (`ringtrain.checkpoint.host_copy`), the files written by a writer process
  reading shared memory (`ringtrain.checkpoint.writer`: what the default writer "auto" picks
  for a state of 64 MB or more);
- `async_thread`: the same, the files written by the writer thread (`writer = "thread"`);
- `async_clone` (not run unless --modes names it): `async` with the strategy's
  `updated_state()` ignored, so every tensor is copied in the snapshot's step: the reference
  that the copy beside the next step is measured against.
- `async_line_first` (not run unless --modes names it): `async` with the whole save after the
  metrics line, as before session 18 (the line's read of the loss waits for the device, and
  the device then idles through the save's host work); the default stages the copies first.
The order rotates from round to round (drift hits each alike). `--strategy zero --zero-stage N`
trains `ZeroStrategy` instead of `ddp`, still on one rank (its shard is the whole model, so
the state and its copies are those of one rank of N, times N).

On CUDA the default snapshot interval (every 100 steps of 205: two timed snapshots per mode,
~2.9 s apart at ~29 ms a step on an H100; ~60 s for the 4 modes, estimated from a 98 s run of
the old default) is longer than a write of the 1.2 GB state (~2.6 s on that box's disk,
measured); with a shorter one (issue 29's every 50: 1.5 s) each snapshot step waits for the
previous write, and the figure measures the disk, not the stall. `--every 50 --steps 300`
still gives that run. The `async` mode's writer process is started before the timed run (a
tiny write through it): a run pays its start (a new interpreter importing torch) once, at its
first snapshot, where it made that snapshot's write outlast the interval. The runs' report.png
is not drawn (matplotlib: seconds per mode, nothing the benchmark reads). Each mode's line and
JSON say how many saves waited for the previous write (`waited_for_write`: count, of, seconds
in all): a mode with any is write-bound, not stalled.

On the CPU, training runs on ONE torch thread by default (`--threads 1`): that emulates a GPU
box, where training is one Python thread feeding the device and the host's other cores are free
for the writer. With every core given to training (`--threads 2` on 2 cores), the writer can
only take time from it, whatever it is.

A step's time on CUDA is the device's, between events recorded at the trainer's `on_step`
calls (`--timing events`: the host queues ahead of the device as in any run, and a save's host
work costs a step only what the device waits for it; `--timing sync`, sessions 15-17's figures:
the wall time after a device synchronisation at each call); on the CPU the wall time between
the calls. The snapshot of step k, taken after `on_step(k)`, lands in the time of step k+1: that
step is a "snapshot step", the others are "other steps"; the first --warmup
steps of each run are not counted. In the background the writer shares the CPU with the steps
that follow a snapshot: they are in "other steps", and in the throughput (steps per second over
the counted steps). The last step's snapshot (the run's end waits for it) is in no step.

Goals (issue 29): async snapshot steps at most 2 % slower than none's steps (p50), async
throughput within 1 % of none with a snapshot every 50 steps; the lines before the JSON say
for each background mode whether they hold. The last line is JSON: {"device", "params",
"strategy", "zero_stage", "every", "steps", "rounds", "snapshot_mb", "modes": {mode:
{"snapshot_step_ms", "other_step_ms" (p50/p95/max/n), "steps_per_s", "save_s_mean",
"waited_for_write": {"n", "of", "s"}, "warm_saves" (background modes with a third save:
{"extra_ms" each, "p50_extra_ms", "base_ms", "projected_throughput": {every: x}}, see
snapshot_warm.py: what a save costs a long run, the drift between runs left out)}},
"{mode}_snapshot_step_vs_none",
"{mode}_throughput_vs_none", "goals": {mode: {"snapshot_step": bool, "throughput": bool}},
loadavg}. `save_s_mean` is the time the step spent in a save: the whole save for sync, the
in-step part of the host copy for the background modes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from snapshot_warm import projected_throughput, warm_saves
from torch.utils.data import Dataset

SHAPES = {  # per device type: the model (~99 M parameters) and a batch that keeps it busy
    "cuda": {"n_layer": 14, "n_head": 12, "n_embd": 768, "block_size": 512, "batch_size": 8,
             "steps": 205, "every": 100},  # an interval longer than a write: see above
    "cpu": {"n_layer": 14, "n_head": 12, "n_embd": 768, "block_size": 64, "batch_size": 2,
            "steps": 160, "every": 50},
    "quick": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 32, "batch_size": 4,
              "steps": 40, "every": 10},
}
VOCAB = 65
MODES = ("none", "sync", "async", "async_thread", "async_clone", "async_line_first")
DEFAULT_MODES = MODES[:4]
# BackgroundSaves.writer per mode
WRITER = {"async": "process", "async_thread": "thread", "async_clone": "process",
          "async_line_first": "process"}
GOALS = {"snapshot_step": 1.02, "throughput": 0.99}  # issue 29: async vs none


class RandomTokens(Dataset):
    """(input, target) windows of random tokens: what is learned does not matter here."""

    def __init__(self, n: int, block_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n + block_size + 1,), generator=g)
        self.n, self.block_size = n, block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        w = self.tokens[i:i + self.block_size + 1]
        return w[:-1], w[1:]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU: no CUDA call there)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_run(mode: str, shape: dict, args, runtime, run_dir: Path) -> dict:
    """Train `args.steps` steps in `mode`; each step's seconds and the trainer's summary."""
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    device = runtime.device
    model = GPTConfig(vocab_size=VOCAB, block_size=shape["block_size"], n_layer=shape["n_layer"],
                      n_head=shape["n_head"], n_embd=shape["n_embd"], dropout=0.0)
    config = TrainerConfig(steps=args.steps, batch_size=shape["batch_size"], lr=6e-4, seed=1337,
                           dtype="bf16" if device.type == "cuda" else "fp32",
                           log_every=args.every, eval_every=args.steps, progress=False)
    data = RandomTokens(max(1024, 2 * shape["batch_size"]), shape["block_size"])
    options = {"zero_stage": args.zero_stage} if args.strategy == "zero" else {}
    strategy = make_strategy(args.strategy, runtime=runtime, **options)
    if mode == "async_clone":  # nothing declared: the whole state copied in the step
        strategy.updated_state = lambda: None
    trainer = Trainer(strategy, runtime, lambda: GPT(model), data,
                      None, loss_fn, config, run_dir=str(run_dir),
                      snapshot_every=0 if mode == "none" else args.every,
                      sync_snapshots=mode == "sync", resume=False, name=f"stall-{mode}")
    marks: list[float] = []
    events: list = []  # --timing events: one CUDA event a step, read after the run

    def mark() -> None:
        if device.type == "cuda" and args.timing == "events":
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        else:
            sync(device)
        marks.append(time.perf_counter())

    def on_step(step: int) -> None:
        mark()
    trainer.on_step = on_step
    if mode in WRITER:
        trainer.snapshots.manager.background_saves.writer = WRITER[mode]
    if mode == "async_line_first":
        line_first(trainer.snapshots)
    waits = count_waits(trainer.snapshots)
    if WRITER.get(mode) == "process":  # started before the timed run (see the docstring)
        bg = trainer.snapshots.manager.background_saves
        bg.using = "process"  # what `stage` picks for this mode at the first save
        run_dir.mkdir(parents=True, exist_ok=True)
        bg.write_file()(run_dir / "writer-warm-up.pt", {})
    sync(device)
    mark()
    summary = trainer.fit()
    sync(device)
    step_s = ([a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:], strict=False)]
              if events else [b - a for a, b in zip(marks, marks[1:], strict=False)])
    trainer.strategy.close()
    if trainer.snapshots is not None:
        trainer.snapshots.manager.close()  # the writer process, if one was started
    params = sum(p.numel() for p in trainer.model.parameters())
    from ringtrain.checkpoint.files import newest_snapshot_bytes

    size = newest_snapshot_bytes(run_dir / "snapshots")
    del trainer
    gc.collect()
    return {"step_s": step_s, "marks": marks,
            "params": params,
            "save_s_mean": summary.get("snapshot_s_mean"), "snapshot_bytes": size,
            "waits": waits}


def line_first(loop) -> None:
    """The order before session 18 in `loop` (the trainer's `LoopSnapshots`): the whole save
    after the metrics line, whose read of the loss has waited for the device by then."""
    stage = loop.stage

    class After:
        def __init__(self, step: int):
            self.step = step

        def save(self, reason: str = "periodic") -> None:
            staged = stage(self.step)
            if staged is not None:
                staged.save(reason)

        def drop(self) -> None:
            pass
    loop.stage = After


def count_waits(loop) -> list[float | None]:
    """Per save of `loop` (the trainer's `LoopSnapshots`): the seconds it waited for the
    previous write to end, None when none was being written. `LoopSnapshots.stage` waits for
    the save in flight first (and warns once past a second); this wrapper makes the same
    wait just before it, so it is counted every time (the inner wait then finds nothing)."""
    waits: list[float | None] = []
    if loop is None:
        return waits
    inner = loop.stage  # the trainer's save: `stage` before the metrics line, then `save`

    def stage(step: int):
        writing, t0 = loop.manager.writing, time.perf_counter()
        loop.wait()
        waits.append(time.perf_counter() - t0 if writing else None)
        return inner(step)
    loop.stage = stage
    return waits


def percentiles(ms: list[float]) -> dict | None:
    if not ms:
        return None
    s = sorted(ms)
    return {"p50": round(statistics.median(s), 3),
            "p95": round(s[min(len(s) - 1, round(0.95 * (len(s) - 1)))], 3),
            "max": round(s[-1], 3), "n": len(s)}


def split(step_s: list[float], every: int, warmup: int) -> tuple[list[float], list[float]]:
    """(snapshot steps, other steps) in ms; step k (1-based) holds the snapshot of step k-1."""
    snap, other = [], []
    for i, s in enumerate(step_s):
        k = i + 1
        if k <= warmup:
            continue
        (snap if k > 1 and (k - 1) % every == 0 else other).append(1e3 * s)
    return snap, other


def histogram(runs: dict[str, list[float]], bins: int = 12) -> list[str]:
    """Lines of a text histogram of step ms, one column of counts per mode."""
    every = [x for v in runs.values() for x in v]
    lo, hi = min(every), max(every)
    width = (hi - lo) / bins or 1.0
    lines = [f"{'step ms':>19s}  " + "  ".join(f"{m:>6s}" for m in runs)]
    for b in range(bins):
        a = lo + b * width
        counts = [sum(1 for x in v if a <= x < a + width or (b == bins - 1 and x == hi))
                  for v in runs.values()]
        lines.append(f"{a:9.1f} - {a + width:7.1f}  " + "  ".join(f"{c:6d}" for c in counts))
    return lines


def main(argv: list[str] | None = None) -> dict:
    from ringtrain.launch.network import free_port
    from ringtrain.launch.process_group import destroy_distributed, init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and a short run (seconds)")
    for key in SHAPES["cpu"]:
        p.add_argument("--" + key.replace("_", "-"), type=int,
                       help=f"default: {SHAPES['cuda'][key]} on CUDA, {SHAPES['cpu'][key]} on "
                       f"the CPU, {SHAPES['quick'][key]} with --quick")
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, order rotated")
    p.add_argument("--warmup", type=int, default=3, help="first steps of a run not counted")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for training on the CPU (default 1: a GPU box's layout, "
                   "the other cores left to the writer; 0: torch's default)")
    p.add_argument("--dir", help="where the snapshots go (default: a temporary directory)")
    p.add_argument("--strategy", choices=("ddp", "zero"), default="ddp",
                   help="the strategy trained (one rank either way)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2,
                   help="with --strategy zero: its stage")
    p.add_argument("--timing", choices=("events", "sync"), default="events",
                   help="CUDA: a step's time between events recorded at each step's end (the "
                        "device's timeline; the host runs ahead as in a real run), or the wall "
                        "time after a device synchronisation each step (sessions 15-17: the "
                        "host never runs ahead, so a save's host work is never hidden)")
    p.add_argument("--phases", action="store_true",
                   help="print where each snapshot step's time went (snapshot_phases.py)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, 'none' first (of {', '.join(MODES)})")
    args = p.parse_args(argv)
    modes_run = tuple(args.modes.split(","))
    if modes_run[0] != "none" or not set(modes_run) <= set(MODES) or len(set(modes_run)) < 2:
        p.error(f"--modes {args.modes}: 'none' first (the reference), then one or more of "
                f"{', '.join(MODES[1:])}")
    before = os.getloadavg()
    runtime = init_distributed(rank=0, world_size=1, master_addr="127.0.0.1",
                               master_port=free_port())
    device = runtime.device
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)  # the process's: the writer thread's copies too
    defaults = SHAPES["quick" if args.quick else "cuda" if device.type == "cuda" else "cpu"]
    shape = {k: getattr(args, k) or v for k, v in defaults.items()}
    args.steps, args.every = shape["steps"], shape["every"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # First, so that a run cut off by a time limit still says what it ran.
    print(f"device {name} (torch {torch.__version__}), shape {shape}, every {args.every}, "
          f"steps {args.steps}, rounds {args.rounds}, strategy {args.strategy}"
          f"{f' stage {args.zero_stage}' if args.strategy == 'zero' else ''}, "
          f"modes {', '.join(modes_run)}", flush=True)
    import ringtrain.training.report as report
    report.write_report = lambda *a, **k: None  # see the docstring
    if args.every < 2 or args.steps < args.every + 2:
        p.error(f"--every {args.every} --steps {args.steps}: take at least one snapshot whose "
                "next step is timed (--steps >= --every + 2, --every >= 2)")
    steps: dict[str, list[float]] = {m: [] for m in modes_run}
    saves: dict[str, list[float]] = {m: [] for m in modes_run}
    waits: dict[str, list[float | None]] = {m: [] for m in modes_run}
    params = size = None
    phases = None
    if args.phases:
        from snapshot_phases import Phases
        phases = Phases()
        phases.install()
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # a folder to make, not a failure
    try:
        with tempfile.TemporaryDirectory(prefix="snapshot_stall_", dir=args.dir) as tmp:
            for r in range(args.rounds):
                turn = r % len(modes_run)
                for mode in modes_run[turn:] + modes_run[:turn]:
                    out = one_run(mode, shape, args, runtime, Path(tmp) / f"{mode}-{r}")
                    steps[mode].append(out["step_s"])  # per run: split knows the step numbers
                    waits[mode] += out["waits"]
                    if out["save_s_mean"] is not None:
                        saves[mode].append(out["save_s_mean"])
                    params, size = out["params"], out["snapshot_bytes"] or size
                    mean = statistics.fmean(out["step_s"][args.warmup:])
                    print(f"round {r} {mode:5s}: {1e3 * mean:9.2f} ms/step mean", flush=True)
                    if phases is not None:
                        lines = phases.lines(mode, out["marks"], phases.take(), args.every)
                        print("\n".join(lines), flush=True)
    finally:
        destroy_distributed()
        if phases is not None:
            phases.remove()
    modes, split_ms = {}, {}
    for mode in modes_run:
        snap, other = [], []
        for run in steps[mode]:
            a, b = split(run, args.every, args.warmup)
            snap, other = snap + a, other + b
        if mode == "none":  # no snapshot: every step is an "other step"
            snap, other = [], snap + other
        split_ms[mode] = snap + other
        modes[mode] = {"snapshot_step_ms": percentiles(snap), "other_step_ms": percentiles(other),
                       "snapshot_steps_ms": [round(x, 1) for x in snap],  # each, in order
                       "steps_per_s": round(1e3 * len(split_ms[mode]) / sum(split_ms[mode]), 4),
                       "save_s_mean": (round(statistics.fmean(saves[mode]), 4)
                                       if saves[mode] else None),
                       "waited_for_write": {
                           "n": sum(w is not None for w in waits[mode]), "of": len(waits[mode]),
                           "s": round(sum(w for w in waits[mode] if w is not None), 3)}}
    for mode in modes_run[1:]:  # a warm save's cost within its own run (snapshot_warm.py)
        per_run = [warm_saves([1e3 * x for x in run], args.every, args.warmup, after=3)
                   for run in steps[mode]]
        per_run = [w for w in per_run if w is not None]
        extra = [x for w in per_run for x in w["extra_ms"]]
        if extra:
            base = statistics.median(w["base_ms"] for w in per_run)
            cost = statistics.median(extra)
            modes[mode]["warm_saves"] = {
                "extra_ms": extra, "p50_extra_ms": round(cost, 2), "base_ms": round(base, 3),
                "projected_throughput": {str(n): projected_throughput(cost, base, n)
                                         for n in sorted({50, args.every})}}
    none = modes["none"]
    ratio = {}
    goals = {}
    for mode in modes_run[1:]:
        ratio[f"{mode}_snapshot_step_vs_none"] = round(
            modes[mode]["snapshot_step_ms"]["p50"] / none["other_step_ms"]["p50"], 4)
        ratio[f"{mode}_throughput_vs_none"] = round(
            modes[mode]["steps_per_s"] / none["steps_per_s"], 4)
        goals[mode] = {"snapshot_step": ratio[f"{mode}_snapshot_step_vs_none"]
                       <= GOALS["snapshot_step"],
                       "throughput": ratio[f"{mode}_throughput_vs_none"] >= GOALS["throughput"]}
    print("\n".join(histogram(split_ms)))
    for mode in modes_run:
        m = modes[mode]
        print(f"{mode:5s}  snapshot steps {m['snapshot_step_ms']}  other steps "
              f"{m['other_step_ms']}  {m['steps_per_s']} steps/s  save in step "
              f"{m['save_s_mean']} s")
        if warm := m.get("warm_saves"):
            print(f"{mode:5s}  warm saves (the third on) cost {warm['extra_ms']} ms each over "
                  f"4 steps of its runs' {warm['base_ms']} ms: at that cost a save every "
                  + ", ".join(f"{n} steps keeps {x}x" for n, x in
                              warm["projected_throughput"].items())
                  + " of the throughput (an estimate: snapshot_warm.py)")
        w = m["waited_for_write"]
        if w["n"]:
            print(f"{mode:5s}  {w['n']} of {w['of']} saves waited for the previous write "
                  f"({w['s']} s in all): write-bound, raise --every to measure the stall")
    if device.type == "cpu":
        free = torch.get_num_threads() < (os.cpu_count() or 1)
        print(f"CPU: training on {torch.get_num_threads()} torch thread(s) of {os.cpu_count()} "
              "cores; the writer " + ("runs on the others (a GPU box emulated)" if free
                                      else "competes with training for them (none left)"))
    for mode in modes_run[1:]:
        said = {k: "met" if v else "NOT met" for k, v in goals[mode].items()}
        print(f"goals, {mode:12s}: snapshot step p50 {ratio[f'{mode}_snapshot_step_vs_none']}x "
              f"a plain step (<= {GOALS['snapshot_step']}x: {said['snapshot_step']}), "
              f"throughput {ratio[f'{mode}_throughput_vs_none']}x none (>= "
              f"{GOALS['throughput']}x: {said['throughput']})")
    result = {"device": name, "torch": torch.__version__, "params": params, "shape": shape,
              "strategy": args.strategy,
              "zero_stage": args.zero_stage if args.strategy == "zero" else None,
              "every": args.every, "steps": args.steps, "rounds": args.rounds,
              "warmup": args.warmup, "timing": args.timing if device.type == "cuda" else "wall",
              "threads": torch.get_num_threads() if device.type == "cpu" else None,
              "snapshot_mb": round(size / 1e6, 1) if size else None, "modes": modes, **ratio,
              "goals": goals,
              "loadavg_before": before, "loadavg_after": os.getloadavg()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
