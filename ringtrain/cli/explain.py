"""`ringtrain explain RUN_DIR`: what a `ringtrain train` run did, told in the learner's words.

    ringtrain train --nproc-per-node 2 --steps 50 --run-dir runs/a
    ringtrain explain runs/a

From the files `ringtrain train` wrote (config.json, summary.json, metrics.jsonl, snapshots/):
each rank's role, the data split, what travelled between ranks each step and by which algorithm,
communication against compute, and the snapshot a resume would use. `load_run` reads the files,
`explain` makes the text from them alone (tests call it without processes); docs/concepts.md
explains each word. Not a run directory: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import statistics
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtrain.errors import USAGE_EXIT_CODE, ConfigError

FP32_BYTES = 4  # gradients, parameters and activations travel in fp32 (under bf16 autocast too)
WIDTH = 100  # the text wraps here; a command to copy stays on one line


@dataclass(frozen=True)
class RunFiles:
    """What a run directory holds, read once by `load_run`; `explain` needs nothing else."""

    path: str
    config: dict[str, Any]
    summary: dict[str, Any] | None  # None: the run did not finish (or is still running)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    snapshots: int = 0  # committed snapshot directories
    resume_step: int | None = None  # of the newest committed snapshot that verifies
    resume_path: str | None = None
    resume_replicated: bool | None = None  # the snapshot holds the whole state on every rank
    skipped: list[str] = field(default_factory=list)  # snapshots a resume would skip, and why
    train_samples: int | None = None  # None: unknown (a --data file that is gone)
    eval_samples: int | None = None


# ---- reading the run directory ------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    try:  # a missing file says the directory is not a run's; a broken one says which file
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path.parent} has no {path.name} ({what}), so it is not the run "
                          "directory of a `ringtrain train` run; pass the --run-dir of one") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it ({e}); {what}") from None


def _dataset_sizes(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(train, eval) samples of the run's task, as `ringtrain train` built them."""
    args = config["args"]
    if config.get("task") == "addition":
        from ringtrain.data.addition import train_size

        digits = int(args.get("digits") or 2)
        return train_size(digits), 10 ** (2 * digits) - train_size(digits)
    from ringtrain.data.chars import load_text

    try:
        text = load_text(args["data"], args["block_size"])
    except (KeyError, TypeError, ValueError):  # the file moved or changed: "unknown"
        return None, None
    return len(text.train_set), len(text.eval_set)


def _resume_point(root: Path) -> tuple[int, int | None, str | None, bool | None, list[str]]:
    """(committed snapshots, step, path and replicated flag of the snapshot a resume would use,
    what it would skip and why)."""
    if not root.is_dir():
        return 0, None, None, None, []
    from ringtrain.checkpoint.snapshot import SnapshotManager

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snap = SnapshotManager(root, rank=0, world_size=1).latest()  # hashes every file, as a resume
    skipped = [str(w.message).removeprefix("skipping snapshot ") for w in caught]
    committed = sum(1 for p in root.glob("snap-*") if (p / "COMMITTED").exists())
    found = ((snap.step, str(snap.path), snap.metadata.get("replicated")) if snap is not None
             else (None, None, None))
    return committed, *found, skipped


def load_run(path: str | Path) -> RunFiles:
    """Read a run directory; ConfigError (what is wrong, what to pass) when it is not one."""
    root = Path(path)
    if not root.is_dir():
        what = "not a directory" if root.exists() else "no such directory"
        raise ConfigError(f"{path}: {what}; pass the --run-dir of a `ringtrain train` run (it "
                          "holds config.json)")
    config = _read_json(root / "config.json", "rank 0 writes it when the run starts")
    if not isinstance(config, dict) or not {"world_size", "args", "model"} <= set(config):
        raise ConfigError(f"{root / 'config.json'} is not the config.json of `ringtrain train` "
                          "(it needs world_size, args and model); pass the --run-dir of such a run")
    summary = (_read_json(root / "summary.json", "written when the run ends")
               if (root / "summary.json").exists() else None)
    metrics = []
    with contextlib.suppress(FileNotFoundError):
        for line in (root / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a crash
                metrics.append(json.loads(line))
    return RunFiles(str(path), config, summary, metrics, *_resume_point(root / "snapshots"),
                    *_dataset_sizes(config))


# ---- the facts the sections share ----------------------------------------------------------------


@dataclass(frozen=True)
class _Facts:
    name: str  # --strategy
    cls: Any  # its Strategy class; None for one this ringtrain does not know
    options: dict[str, Any]  # its options as set on the command line
    world: int
    params: int
    step_batch: int  # samples per data rank per step: --batch-size x --grad-accum
    data_ranks: int

    def option(self, name: str) -> Any:
        """An option's value: as given, else the strategy constructor's own default."""
        return self.options.get(name, inspect.signature(self.cls.__init__).parameters[name].default)


def _facts(config: dict[str, Any]) -> _Facts:
    from ringtrain.models import GPT, GPTConfig
    from ringtrain.strategies import registered

    args, trainer, world = config["args"], config.get("trainer", {}), config["world_size"]
    name = args.get("strategy", "ddp")
    cls = registered().get(name)
    options = {o.name: args[o.dest] for o in (cls.options if cls else ()) if args.get(o.dest) is not None}
    try:
        params = sum(p.numel() for p in GPT(GPTConfig(**config["model"])).parameters())
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json's model section {config['model']} does not build a GPT "
                          f"({e}); was it written by another version of ringtrain?") from None
    step_batch = trainer.get("batch_size", 1) * trainer.get("grad_accum", 1)
    try:  # the strategy says how many ranks read data (pipeline: dp; ps: the workers)
        data_ranks = cls.plan(options, world, step_batch) if cls else world
    except ValueError:
        data_ranks = world
    return _Facts(name, cls, options, world, params, step_batch, data_ranks)


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _bytes(n: float) -> str:
    return f"{_n(n)} bytes" if n < 1e6 else f"{n / 1e6:,.2f} MB"


def _s(n: int, word: str) -> str:  # '1 rank', '2 ranks'
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(first: int, last: int) -> str:  # 'rank 2', 'ranks 0..1'
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


# ---- the sections ---------------------------------------------------------------------------------


def _roles(f: _Facts) -> list[str]:
    if f.name == "ddp":
        if f.world == 1:
            return [f"1 rank holds the whole GPT ({_n(f.params)} parameters): single-device "
                    "training; the DistributedDataParallel wrapper has no one to average with."]
        return [f"{f.world} ranks, each a full replica of the GPT ({_n(f.params)} parameters "
                "each): every rank runs forward and backward on its own shard of each batch, "
                "then the ranks average their gradients (DistributedDataParallel), so every "
                "replica takes the same optimizer step and the weights stay identical."]
    if f.name == "pipeline":
        pp = f.option("pp")
        dp = f.world // pp
        # --microbatches, or the strategy's default: the most up to 4 x pp dividing the batch.
        m = f.option("microbatches") or next(
            (k for k in range(4 * pp, pp - 1, -1) if f.step_batch % k == 0), 4 * pp)
        lines = [f"{f.world} ranks = {_s(dp, 'pipeline')} x {pp} stages (model parallelism, "
                 f"--pp {pp}): each stage holds a contiguous run of the GPT's layers (embedding, "
                 f"blocks, head) balanced by parameter count, about {_n(f.params / pp)} of the "
                 f"{_n(f.params)} parameters; rank = dp_rank x {pp} + pp_rank."]
        lines += [f"pipeline {d}: " + ", ".join(f"stage {s} on rank {d * pp + s}" for s in range(pp))
                  for d in range(dp)]
        lines.append(f"each step's {f.step_batch} samples flow through the stages as {m} "
                     f"micro-batches of {f.step_batch // m} (--schedule {f.option('schedule')}): "
                     "the stages work at once on different micro-batches, except in the bubble "
                     "at the start and the end of the step.")
        if dp > 1:
            lines.append(f"each stage's {dp} replicas average their gradients "
                         "(DistributedDataParallel on the stage's data-parallel group).")
        return lines
    if f.name == "ps":
        servers, mode = f.option("servers"), f.option("mode")
        workers = f.world - servers
        bound = f" (--staleness {f.option('staleness')})" if mode == "ssp" else ""
        rule = {"sync": "the servers wait for every worker's gradient each step: data parallel "
                        "on the same global batch.",
                "async": "each gradient is applied as it arrives; a worker may compute on stale "
                         "parameters.",
                "ssp": "as async, but no worker runs more steps ahead of the slowest than the "
                       "bound."}.get(mode, "")
        held = "hold the parameters (split between them) and run" if servers > 1 else \
            "holds the parameters and runs"
        return [f"{f.world} ranks: {_s(workers, 'worker')} ({_ranks(0, workers - 1)}) "
                f"compute{'s' if workers == 1 else ''} gradients on the data; "
                f"{_s(servers, 'parameter server')} ({_ranks(workers, f.world - 1)}) {held} the "
                f"optimizer. Mode {mode}{bound}: {rule}"]
    what = (inspect.getdoc(f.cls) or "").splitlines()[0] if f.cls else "not known to this ringtrain"
    return [f"{f.world} ranks, --strategy {f.name}: {what}"]


def _data(run: RunFiles, f: _Facts) -> list[str]:
    args, trainer = run.config["args"], run.config.get("trainer", {})
    batch, accum = trainer.get("batch_size", 1), trainer.get("grad_accum", 1)
    what = (f"addition, {args.get('digits')} digits" if run.config.get("task") == "addition"
            else f"text {args.get('data')}, block size {args.get('block_size')}")
    reader = {"ddp": "every rank", "pipeline": "the stages of a pipeline read the same shard",
              "ps": "the workers; servers read none"}.get(f.name, "as the strategy plans")
    if (n := run.train_samples) is None:
        return [f"task: {what}: the file is not readable from here, so its size is unknown."]
    per_rank = math.ceil(n / f.data_ranks)
    pad = per_rank * f.data_ranks - n
    lines = [f"task: {what}: {_n(n)} training samples, {_n(run.eval_samples or 0)} held out."]
    padding = (f"padded with {_s(pad, 'sample')} repeated from the start of the epoch so every "
               "rank gets as many" if pad else f"no padding: {_n(n)} divides evenly")
    lines.append(f"DistributedSampler: 1 data rank ({reader}) takes all {_n(n)} samples, "
                 "reshuffled every epoch." if f.data_ranks == 1 else
                 f"DistributedSampler: {f.data_ranks} data ranks ({reader}) x {_n(per_rank)} "
                 f"samples per epoch ({padding}); the shards are disjoint, cut from one shuffle "
                 "that every rank draws from the same seed, anew every epoch.")
    steps_per_epoch = per_rank // batch / accum
    steps = (run.summary or {}).get("steps") or trainer.get("steps", 0)
    epochs = (f"; an epoch is {steps_per_epoch:g} steps, so {steps} steps are "
              f"{steps / steps_per_epoch:.2f} epochs" if steps_per_epoch else "")
    lines.append(f"global batch {batch * accum * f.data_ranks} = --batch-size {batch} x "
                 f"--grad-accum {accum} x {_s(f.data_ranks, 'data rank')}{epochs}.")
    lines.append("evaluation splits the held-out set exactly (no padding): its figures are "
                 "those a single process would measure.")
    return lines


def _traffic(run: RunFiles, f: _Facts) -> list[str]:
    grad = f.params * FP32_BYTES
    if f.name == "ddp":
        if f.world == 1:
            return ["nothing: one rank has no one to send to."]
        share, compress, s = 2 * (f.world - 1) / f.world, f.option("grad_compress"), run.summary or {}
        if compress.startswith("powersgd"):  # what it sent is counted, not estimated
            sent = s.get("powersgd_bytes_sent") and s["powersgd_bytes_sent"] / (s.get("steps") or 1)
            return [f"PowerSGD (--grad-compress {compress}): low-rank factors of each gradient "
                    f"matrix, all-reduced by ring, instead of {_bytes(grad)} of fp32 gradients"
                    + (f": {_bytes(sent)} sent per rank per step (summary.json), "
                       f"{share * grad / sent:.1f} x fewer than a ring of the full gradients."
                       if sent else ".")]
        kind, size = (compress, grad // 2) if compress in ("fp16", "bf16") else ("fp32", grad)
        return [f"the gradients of {_n(f.params)} parameters in {kind}: {_bytes(size)}, once per "
                "optimizer step (the --grad-accum micro-batches before the last run under "
                "no_sync), in buckets launched while backward still runs.",
                f"algorithm: ring all-reduce (gloo's default): a reduce-scatter then an "
                f"all-gather, each N-1 steps around the ring, so each rank sends 2(N-1)/N = "
                f"{share:.3g} x the buffer (N = {f.world}) = {_bytes(share * size)} per step, and "
                "receives as much."]
    if f.name == "pipeline":
        model, pp = run.config["model"], f.option("pp")
        dp = f.world // pp
        act = f.step_batch * model["block_size"] * model["n_embd"] * FP32_BYTES
        lines = [f"estimate: between consecutive stages, the activations of a step's "
                 f"{f.step_batch} samples ({model['block_size']} tokens x {model['n_embd']} "
                 f"channels each, fp32) = {_bytes(act)} forward, one micro-batch at a time, and "
                 "as many bytes of their gradients backward; plus one number per stage (the "
                 "gradient norm, for clipping)."]
        if dp > 1:
            lines.append(f"estimate: each stage also all-reduces the gradients of its "
                         f"~{_n(f.params / pp)} parameters among its {dp} replicas: about "
                         f"{_bytes(2 * (dp - 1) / dp * grad / pp)} sent per rank per step (ring).")
        return lines
    if f.name == "ps":
        servers = f.option("servers")
        workers = f.world - servers
        return [f"estimate: each worker pushes its gradients ({_bytes(grad)}) to the servers and "
                f"pulls the new parameters ({_bytes(grad)}) back, every step, point to point (no "
                f"all-reduce); each server receives {_bytes(workers * grad / servers)} per step "
                "(its share of every worker's push) and sends as much back."]
    return [f"not estimated for --strategy {f.name}; the model has {_n(f.params)} parameters "
            f"({_bytes(grad)} in fp32)."]


def _timing(run: RunFiles, f: _Facts) -> list[str]:
    s = run.summary or {}
    compute, comm = s.get("compute_s_per_step"), s.get("comm_s_per_step")
    windows = [m for m in run.metrics if "compute_s" in m and "comm_s" in m][1:]  # not the warm-up
    lines = []
    if compute is not None and comm is not None:
        lines.append(f"last logged window (summary.json): compute {compute * 1e3:.2f} ms, "
                     f"communication {comm * 1e3:.2f} ms per step: "
                     f"{comm / ((compute + comm) or 1):.0%} of the step waiting on other ranks.")
    if windows:
        c = statistics.median(m["compute_s"] for m in windows)
        w = statistics.median(m["comm_s"] for m in windows)
        lines.append(f"median over {len(windows)} logged windows (metrics.jsonl): compute "
                     f"{c * 1e3:.2f} ms, communication {w * 1e3:.2f} ms: {w / ((c + w) or 1):.0%}.")
    note = {"ddp": "the wait after the last local gradient; the buckets all-reduced before it "
                   "overlapped the rest of backward", "pipeline": "waiting for the neighbouring "
                   "stages, the pipeline bubble included", "ps": "the wait for the servers' "
                   "answer (the new parameters)"}.get(f.name, "what the strategy reports as waiting")
    lines.append("no timings: the run logged no step." if not lines else "one rank: what counts "
                 "as communication is the wrapper's bookkeeping; nothing travelled." if f.world == 1
                 else f"communication is {note}.")
    if "staleness_max" in s:
        lines.append(f"staleness (steps a worker was ahead of the slowest when handed "
                     f"parameters): max {s['staleness_max']}, mean {s['staleness_mean']}; update "
                     f"lag (other updates between a gradient's read and its write): max "
                     f"{s.get('update_lag_max')}, mean {s.get('update_lag_mean')}.")
    return lines


def _resume(run: RunFiles, f: _Facts) -> list[str]:
    lines = [f"skipped: {why}" for why in run.skipped]
    if run.resume_step is None:
        every = run.config["args"].get("snapshot_every")
        why = ("no committed snapshot verifies" if run.snapshots or run.skipped
               else "snapshots were off (--snapshot-every 0)" if not every
               else f"no snapshot was written: the run ended before step {every}, the first "
                    f"(--snapshot-every {every})")
        return lines + [f"{why}; a resume would start from step 0."]
    steps = run.config.get("trainer", {}).get("steps")
    left = " (nothing left to train)" if run.resume_step == steps else ""
    where = ("on any number of ranks that divides the global batch (every rank holds the whole "
             "state)" if run.resume_replicated else f"on the same layout (world size {f.world}), "
             "as ranks hold different parts, unless the strategy can re-split them")
    argv = list(run.config.get("argv", []))
    if "--run-dir" in argv:
        argv[argv.index("--run-dir") + 1] = run.path
    return lines + [
        f"{run.resume_path}: step {run.resume_step} of {steps}{left}, the newest of "
        f"{_s(run.snapshots, 'committed snapshot')} whose files match their checksums.",
        f"resume with the same options, {where}:",
        f"    ringtrain train --nproc-per-node {f.world} {' '.join(argv)}"]


def explain(run: RunFiles) -> str:
    """The text `ringtrain explain` prints for `run`."""
    f, s = _facts(run.config), run.summary or {}
    acc = f", eval_accuracy {s['eval_accuracy']:.1%}" if s.get("eval_accuracy") is not None else ""
    state = (f"{s.get('steps')} steps, train_loss {s.get('train_loss') or float('nan'):.4g}{acc}, "
             f"{_s(s.get('restarts', 0), 'restart')}, param_sha256 {str(s.get('param_sha256'))[:16]}..."
             if run.summary else "did not finish (no summary.json): a crash, a stop, or still running")
    sections = [
        ("", [f"run {run.path}: --strategy {f.name} on {_s(f.world, 'rank')}, task "
              f"{run.config.get('task')}: {state}"]),
        ("who did what", _roles(f)),
        ("how the data was split", _data(run, f)),
        ("what travelled between ranks, per step", _traffic(run, f)),
        ("communication against compute", _timing(run, f)),
        ("which snapshot a resume would use", _resume(run, f)),
    ]
    out = []
    for title, lines in sections:
        out += ["", title] if title else []
        out += [line if line.startswith("    ") else textwrap.fill(  # paths stay whole
            line, WIDTH, initial_indent="  " if title else "", subsequent_indent="    ",
            break_on_hyphens=False, break_long_words=False) for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`ringtrain explain RUN_DIR`: 0, or 2 and one line for a directory that is not a run's."""
    p = argparse.ArgumentParser(prog="ringtrain explain", description="Say what a `ringtrain "
                                "train` run did: ranks' roles, data split, traffic, timing, resume.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a `ringtrain train` run")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a usage error (2): argparse has said why
        return int(e.code or 0)
    try:
        text = explain(load_run(args.run_dir))
    except ConfigError as e:
        print(f"ringtrain explain: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    print(text)
    return 0
