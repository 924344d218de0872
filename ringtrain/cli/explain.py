"""`ringtrain explain RUN_DIR`: what a `ringtrain train` run did, told in the learner's words.

    ringtrain train --nproc-per-node 2 --steps 50 --run-dir runs/a
    ringtrain explain runs/a

From the files `ringtrain train` wrote (config.json, summary.json, metrics.jsonl, snapshots/):
each rank's role, the data split, what travelled between ranks each step and by which algorithm,
communication against compute, and the snapshot a resume would use. `load_run` reads the files;
`run_facts` asks the run's strategy for its figures (`Config.figures`: bytes held and sent, in
numbers) and `data_split` computes the sampler's split; `explain` only words them (tests call
each without processes). docs/concepts.md explains each word. Not a run directory: one line,
exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import textwrap
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ringtrain.cli.explain_words import WORDS, Explanation, RunFacts, generic, n, plural
from ringtrain.config.suggest import suggest_flags
from ringtrain.errors import USAGE_EXIT_CODE, ConfigError

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
    earlier: list[int] = field(default_factory=list)  # committed steps before the newest
    set_aside: list[str] = field(default_factory=list)  # "by --resume-from: DIR (steps 4, 6)"


# ---- reading the run directory ------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    try:  # a missing file says the directory is not a run's; a broken one says which file
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path.parent} has no {path.name} ({what}), so it is not the run "
                          "directory of a `ringtrain train` run; pass the --run-dir "
                          "of one") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it ({e}); {what}") from None


def _dataset_sizes(config: dict[str, Any], root: Path) -> tuple[int | None, int | None]:
    """(train, eval) samples of the run's task, as `ringtrain train` built them: the addition
    task's, or the windows of the token directory it trained on (`--data` when it names one; a
    text file's char-level copy in RUN_DIR/data, else the text itself)."""
    args = config["args"]
    if config.get("task") == "addition":
        from ringtrain.data.addition import train_size

        digits = int(args.get("digits") or 2)
        return train_size(digits), 10 ** (2 * digits) - train_size(digits)
    from ringtrain.cli.sample import run_data_dir
    from ringtrain.data.chars import load_text
    from ringtrain.data.tokens import load_tokens

    data, block = args.get("data"), args.get("block_size")
    try:
        directory = run_data_dir(str(root), data)
        sets = load_tokens(directory, block) if os.path.isdir(directory) else load_text(data, block)
    except (KeyError, TypeError, ValueError, OSError):  # moved, changed, or relative elsewhere
        return None, None
    return len(sets.train_set), len(sets.eval_set)


def _resume_point(root: Path) -> tuple[int, int | None, str | None, bool | None, list[str]]:
    """(committed snapshots, step, path and replicated flag of the snapshot a resume would use,
    what it would skip and why)."""
    if not root.is_dir():
        return 0, None, None, None, []
    from ringtrain.checkpoint.rewind import committed_steps
    from ringtrain.checkpoint.snapshot import SnapshotManager

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # hashes every file, as a resume
        snap = SnapshotManager(root, rank=0, world_size=1).latest()
    skipped = [str(w.message).removeprefix("skipping snapshot ") for w in caught]
    committed = len(committed_steps(root))
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
    from ringtrain.cli.dir_contents import holds

    kind = holds(str(root))
    if kind is not None and kind.endswith("export"):  # one model, no run
        raise ConfigError(f"{path} is {kind}, not a run directory; `ringtrain sample {path}` "
                          "generates with it; pass the --run-dir of the run it came from to "
                          "explain that run")
    if kind == "a prepared dataset":
        raise ConfigError(f"{path} is a prepared dataset, not a run directory (ringtrain train "
                          f"--data {path} trains on it); pass the --run-dir of a run")
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
    run = RunFiles(str(path), config, summary, metrics, *_resume_point(root / "snapshots"),
                   *_dataset_sizes(config, root))
    from ringtrain.checkpoint.files import snap_dirs, snap_step
    from ringtrain.checkpoint.rewind import END_PREFIX, FRESH_PREFIX, committed_steps

    earlier = [s for s in committed_steps(root / "snapshots") if s < (run.resume_step or 0)]
    aside = []
    for d in sorted((root / "set-aside").glob("*")):
        if d.name.startswith(END_PREFIX):  # a finished run's end, when it went on past it
            aside.append(f"by going on past the end at step {d.name.split('-')[1]}: {d} (that "
                         f"end's {', '.join(sorted(p.name for p in d.iterdir()))})")
            continue
        fresh = d.name.startswith(FRESH_PREFIX)  # --no-resume's: the whole run
        steps = sorted(map(snap_step, snap_dirs(d / "snapshots" if fresh else d)))
        aside.append(f"by {'--no-resume' if fresh else '--resume-from'}: {d} "
                     f"({'steps ' + ', '.join(map(str, steps)) if steps else 'no snapshot'})")
    return replace(run, earlier=earlier, set_aside=aside)


# ---- the numbers the sections word ---------------------------------------------------------------


def run_facts(run: RunFiles) -> RunFacts:
    """The run's strategy, its options and its figures (`Config.figures`), the model's size."""
    from ringtrain.models import GPT, GPTConfig
    from ringtrain.strategies import registered
    from ringtrain.strategies.figures import Workload
    from ringtrain.strategies.layouts import whole_numel

    config, trainer = run.config, run.config.get("trainer", {})
    args, world = config["args"], config["world_size"]
    name = args.get("strategy", "ddp")
    cls = registered().get(name)
    strategy = None
    if cls:  # config.json's args hold the options by flag words (ps_mode), as --help shows them
        from ringtrain.cli.train_args import parsed_text
        from ringtrain.config import set_values

        strategy = cls.Config(**set_values(cls.Config, parsed_text(args)))
    try:
        gpt = GPT(GPTConfig(**config["model"]))
        params = sum(p.numel() for p in gpt.parameters())
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json's model section {config['model']} does not build a GPT "
                          f"({e}); was it written by another version of ringtrain?") from None
    accum = trainer.get("grad_accum", 1)
    step_batch = trainer.get("batch_size", 1) * accum
    model = config["model"]
    sample = model.get("block_size", 0) * model.get("n_embd", 0)
    figures, refused = None, ""
    try:  # options the strategy refuses for this world size: no figures, the generic words
        if strategy:
            figures = strategy.figures(Workload(
                world, params, step_batch, accum, sample, model.get("n_layer", 0),
                block_size=model.get("block_size", 0), vocab_size=model.get("vocab_size", 0),
                whole_params=whole_numel(gpt)))
    except ValueError as e:
        refused = str(e)
    return RunFacts(name, cls, strategy, world, params, step_batch, figures,
                    model=config["model"], summary=run.summary or {}, refused=refused)


@dataclass(frozen=True)
class DataSplit:
    """How the DistributedSampler split the training set (`samples` None: the file is gone)."""

    samples: int | None
    data_ranks: int
    per_rank: int  # samples per data rank per epoch: ceil(samples / data_ranks)
    padding: int  # samples repeated so that every rank gets as many
    global_batch: int  # --batch-size x --grad-accum x data ranks
    steps: int  # the run's optimizer steps (summary.json's, else the configured number)
    steps_per_epoch: float  # optimizer steps
    epochs: float  # the run's steps, in epochs (0: an epoch is shorter than one step)


def data_split(run: RunFiles, f: RunFacts) -> DataSplit:
    """The sampler's split of the run's training set among the strategy's data ranks."""
    trainer = run.config.get("trainer", {})
    batch, accum = trainer.get("batch_size", 1), trainer.get("grad_accum", 1)
    steps = (run.summary or {}).get("steps") or trainer.get("steps", 0)
    samples, ranks = run.train_samples, f.data_ranks
    per_rank = math.ceil(samples / ranks) if samples is not None else 0
    padding = per_rank * ranks - samples if samples is not None else 0
    steps_per_epoch = per_rank // batch / accum
    return DataSplit(samples, ranks, per_rank, padding, batch * accum * ranks, steps,
                     steps_per_epoch, steps / steps_per_epoch if steps_per_epoch else 0.0)


def _explanation(f: RunFacts) -> Explanation:
    """The strategy's words (`explain_words.WORDS`); the generic ones for any other."""
    return WORDS[f.name](f) if f.figures and f.name in WORDS else generic(f)


# ---- the sections -------------------------------------------------------------------------------


def _data(run: RunFiles, f: RunFacts, reader: str) -> list[str]:
    args, trainer = run.config["args"], run.config.get("trainer", {})
    what = (f"addition, {args.get('digits')} digits" if run.config.get("task") == "addition"
            else f"text {args.get('data')}, block size {args.get('block_size')}")
    if args.get("pad_vocab", 1) > 1:
        what += (f", the model's vocabulary padded to {run.config['model']['vocab_size']} rows "
                 f"(--pad-vocab {args['pad_vocab']}: the rows no token uses)")
    split = data_split(run, f)
    if (samples := split.samples) is None:
        return [f"task: {what}: not found from here (a relative --data is read from where the "
                "run started: explain from there, or pass the absolute path to --data next "
                "time), so its size is unknown."]
    lines = [f"task: {what}: {n(samples)} training samples, {n(run.eval_samples or 0)} held out."]
    padding = (f"padded with {plural(split.padding, 'sample')} repeated from the start of the "
               "epoch so every rank gets as many" if split.padding else
               f"no padding: {n(samples)} divides evenly")
    lines.append(f"DistributedSampler: 1 data rank ({reader}) takes all {n(samples)} samples, "
                 "reshuffled every epoch." if split.data_ranks == 1 else
                 f"DistributedSampler: {split.data_ranks} data ranks ({reader}) x "
                 f"{n(split.per_rank)} samples per epoch ({padding}); the shards are disjoint, "
                 "cut from one shuffle that every rank draws from the same seed, anew every "
                 "epoch.")
    epochs = (f"; an epoch is {split.steps_per_epoch:g} steps, so {split.steps} steps are "
              f"{split.epochs:.2f} epochs" if split.steps_per_epoch else "")
    lines.append(f"global batch {split.global_batch} = --batch-size "
                 f"{trainer.get('batch_size', 1)} x --grad-accum {trainer.get('grad_accum', 1)} "
                 f"x {plural(split.data_ranks, 'data rank')}{epochs}.")
    lines.append("evaluation splits the held-out set exactly (no padding): its figures are "
                 "those a single process would measure.")
    return lines


def _timing(run: RunFiles, f: RunFacts, note: str) -> list[str]:
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
    lines.append("no timings: the run logged no step." if not lines else "one rank: what counts "
                 "as communication is the wrapper's bookkeeping; nothing travelled." if f.world == 1
                 else f"communication is {note}.")
    if "staleness_max" in s:
        lines.append(f"staleness (steps a worker was ahead of the slowest when handed "
                     f"parameters): max {s['staleness_max']}, mean {s['staleness_mean']}; update "
                     f"lag (other updates between a gradient's read and its write): max "
                     f"{s.get('update_lag_max')}, mean {s.get('update_lag_mean')}.")
    return lines


def _resume(run: RunFiles, f: RunFacts) -> list[str]:
    lines = [f"skipped: {why}" for why in run.skipped]
    if run.resume_step is None:
        every = run.config["args"].get("snapshot_every")
        why = ("no committed snapshot verifies" if run.snapshots or run.skipped
               else "snapshots were off (--snapshot-every 0)" if not every
               else f"no snapshot was written: the run ended before step {every}, the first "
                    f"(--snapshot-every {every})")
        return lines + [f"{why}; a resume would start from step 0."]
    steps = run.config.get("trainer", {}).get("steps")
    stopped_early = ((run.summary or {}).get("steps") == run.resume_step != steps
                     and run.config["args"].get("stop_at_accuracy") is not None)
    left = (" (nothing left to train)" if run.resume_step == steps else
            " (where the run stopped early: the same command trains nothing, a higher "
            "--stop-at-accuracy goes on from it)" if stopped_early else "")
    where = ("on any number of ranks that divides the global batch (every rank holds the whole "
             "state)" if run.resume_replicated else f"on the same layout (world size {f.world}) "
             "to load each rank's part as it was saved")
    anywhere = ("or with any other --strategy and number of ranks that keeps the global batch: "
                "the state is converted by parameter name (docs/train.md, local SGD and DiLoCo "
                "from a snapshot at a meeting)")
    argv = _command_line(run)
    return lines + [
        f"{run.resume_path}: step {run.resume_step} of {steps}{left}, the newest of "
        f"{plural(run.snapshots, 'committed snapshot')} whose files match their checksums.",
        f"resume with the same options, {where}:",
        f"    ringtrain train --nproc-per-node {f.world} {' '.join(argv)}", anywhere,
        *([f"or go back to an earlier snapshot with --resume-from STEP, one of "
           f"{', '.join(map(str, run.earlier))} (the later ones are set aside, not deleted)."]
          if run.earlier else []),
        *[f"set aside {d}" for d in run.set_aside]]


def _command_line(run: RunFiles) -> list[str]:
    """The run's options as flags, its --run-dir this directory (older runs kept an "argv")."""
    from ringtrain.cli.train_args import command_line

    try:
        argv = command_line({**run.config["args"], "run_dir": run.path, "resume": True,
                             "resume_from": None})  # the newest: a rewind is done once
    except ValueError:  # written by another version of ringtrain: what it kept, if anything
        argv = list(run.config.get("argv", []))
    return argv


def explain(run: RunFiles) -> str:
    """The text `ringtrain explain` prints for `run`."""
    from ringtrain.checkpoint.run_lock import holder

    f, s = run_facts(run), run.summary or {}
    said = _explanation(f)
    acc = f", eval_accuracy {s['eval_accuracy']:.1%}" if s.get("eval_accuracy") is not None else ""
    state = (f"{s.get('steps')} steps, train_loss {s.get('train_loss') or float('nan'):.4g}{acc}, "
             f"{plural(s.get('restarts', 0), 'restart')}, "
             f"param_sha256 {str(s.get('param_sha256'))[:16]}..."
             if run.summary
             else "did not finish (no summary.json): a crash, a stop, or still running")
    start = run.config["args"].get("init_from")
    started = [f"started from the weights of {start} (--init-from), not a random init"] if (
        start) else []
    if running := holder(run.path):  # its lock: a resume now would be refused
        started.append(f"training now ({running}): what follows is as of its files so far")
    sections = [
        ("", [f"run {run.path}: --strategy {f.name} on {plural(f.world, 'rank')}, task "
              f"{run.config.get('task')}: {state}", *started]),
        ("who did what", said.roles),
        ("how the data was split", _data(run, f, said.reader)),
        ("what travelled between ranks, per step", said.traffic),
        ("communication against compute", _timing(run, f, said.waiting)),
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
    p = suggest_flags(argparse.ArgumentParser(
        prog="ringtrain explain", description="Say what a `ringtrain train` run did: ranks' "
        "roles, data split, traffic, timing, resume."))
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
