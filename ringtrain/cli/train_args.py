"""The command line of `ringtrain train`, generated from the option tree (`cli/options.py`).

    ringtrain train --help

`build_parser` makes the parser from the dataclass fields; `options_from` turns what was given
(argv, or a worker's RUN_DIR/config.json) into a `TrainOptions`, applying the defaults in order
(field, task, strategy, --init-from's model shape, recipe, command line) and the classes' own
checks; `check_args` finds what needs more than one section or the machine (cores, devices,
the data file, the layout of the strategy over the ranks). Errors name fields (`lr=0.0`);
`options_from` and `check_args` say them with flags (`--lr 0.0`) through
`ringtrain.config.to_flags`, the one place that maps them. The data and trainer modules are
imported inside the functions, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from ringtrain.cli.options import (
    SECTIONS,
    TASK_DEFAULTS,
    TrainOptions,
    every_option_class,
    per_task_text,
)
from ringtrain.config import add_section, dest, flag, resume_fields, set_values, to_flags
from ringtrain.config.fields import default_text, meta, option_fields
from ringtrain.config.recipes import load as load_recipe
from ringtrain.config.suggest import suggest_flags
from ringtrain.launch.device import choose, launcher_gpu_count
from ringtrain.strategies import registered


class _Parser(argparse.ArgumentParser):
    """--help lists every option; a mistake gets one usage line (the full one is 25 lines)."""

    def format_usage(self) -> str:  # used by error() and print_usage(); --help builds its own
        return f"usage: {self.prog} [options]; `{self.prog} --help` lists them\n"


def build_parser() -> argparse.ArgumentParser:
    """The parser, every option from its field; every argument defaults to None (unset)."""
    # No abbreviations: one that works today would mean another flag, or stop working, once a
    # flag sharing its prefix is added (`--resume` became `--resume-from` that way).
    p = _Parser(
        prog="ringtrain train", description="Train a GPT on 2-digit addition (default) or on your "
        "text (--data), on one or many processes. Every option has a default.", allow_abbrev=False)
    for title, cls in SECTIONS.items():
        add_section(p, cls, title, shown=per_task_text)
    # Each strategy's options, from its Config, in groups by the strategies that take them: a
    # flag several share (diloco extends localsgd; --tp: pipeline and tp) is listed once, under
    # a title naming them all, its default as each one's where they differ.
    for names, fields_ in strategy_groups():
        add_section(p, registered()[names[0]].Config, "--strategy " + ", ".join(names),
                    skip={flag(f) for f in option_fields(registered()[names[0]].Config)} -
                    {flag(f) for f in fields_}, shown=lambda f, names=names: _default_of(f, names))
    return suggest_flags(p)


def strategy_groups() -> list[tuple[tuple[str, ...], list]]:
    """[(strategy names, their shared fields)]: every strategy option once, grouped by the
    strategies that declare it (registry order; a strategy's own options come first)."""
    owners: dict[str, list[str]] = {}
    for name, cls in registered().items():
        for f in option_fields(cls.Config):
            owners.setdefault(flag(f), []).append(name)
    groups: dict[tuple[str, ...], list] = {}
    for name, cls in registered().items():
        for f in option_fields(cls.Config):
            if owners[flag(f)][0] == name:
                groups.setdefault(tuple(owners[flag(f)]), []).append(f)
    return sorted(groups.items(), key=lambda g: (list(registered()).index(g[0][0]), len(g[0])))


def _default_of(f, names: tuple[str, ...]) -> str | None:
    """A shared option's default in --help: one text, or each strategy's where they differ
    ("1 (pipeline) / 2 (tp)")."""
    texts = {name: default_text(next(g for g in option_fields(registered()[name].Config)
                                     if g.name == f.name)) for name in names}
    if len(set(texts.values())) == 1:
        return texts[names[0]]
    return " / ".join(f"{text} ({name})" for name, text in texts.items())


def _flag_owners() -> dict[str, list[str]]:
    """--flag -> the strategies that declare it."""
    return {flag(f): list(names) for names, fields_ in strategy_groups() for f in fields_}


def parse_options(argv: list[str]) -> TrainOptions:
    """argv -> options (argparse exits on a malformed flag; ValueError for the rest)."""
    return options_from(vars(build_parser().parse_args(argv)))


def options_from(given: Mapping[str, Any], *, parse_text: bool = False) -> TrainOptions:
    """The options from `given` ({dest: value}, None for unset), the defaults filled in.

    Args:
        parse_text: `given` came from JSON (a worker's config.json): a text value of an option
            with a parser (`--trace-steps 3:5`) is parsed again.
    """
    from ringtrain.formats.init_from import shape_options

    given = {k: v for k, v in given.items() if v is not None}
    if parse_text:
        given = parsed_text(given)
    task = "text" if given.get("data") else "addition"
    recipe = parsed_text(load_recipe(given["recipe"])) if given.get("recipe") else {}
    _check_names(recipe, f"recipe={given.get('recipe')!r}")
    start = {**recipe, **given}.get("init_from")
    shape = shape_options(start) if start else {}  # its model's, where no option sets one
    values = {**TASK_DEFAULTS[task], **shape, **recipe, **given}
    strategies = registered()
    given = {**given, "strategy": strategy_name(values)}  # --pp 2 alone: pipeline
    chosen = strategies[given["strategy"]]
    mine = {flag(f) for f in option_fields(chosen.Config)}
    for flag_, names in _flag_owners().items():
        if flag_ not in mine and flag_[2:].replace("-", "_") in {**recipe, **given}:
            which = " or ".join(f"--strategy {n}" for n in names)
            raise ValueError(f"{flag_} applies to {which}, not {chosen.name}; "
                             f"add {which.split(' or ')[0]} or drop {flag_}")
    try:
        strategy = chosen.Config(**set_values(chosen.Config, values))
        values = {**TASK_DEFAULTS[task], **strategy.trainer_defaults(), **shape, **recipe,
                  **given}
        sections = {name: cls(**set_values(cls, values)) for name, cls in SECTIONS.items()}
        return TrainOptions(**sections, strategy=strategy)
    except ValueError as e:  # "lr=0.0: ..." -> "--lr 0.0: ..."
        raise ValueError(to_flags(str(e), every_option_class())) from None


def strategy_name(values: Mapping[str, Any]) -> str:
    """--strategy as given (or by the recipe); else the first strategy (by name) whose
    `Config.chosen_by` options are among `values` (--pp: pipeline, whose --tp then splits each
    stage; --tp alone: tp); else ddp. Said in `--strategy`'s help."""
    implied = (name for name, cls in registered().items()
               if any(values.get(k) is not None for k in cls.Config.chosen_by))
    return values.get("strategy") or next(implied, "ddp")


def parsed_text(values: dict[str, Any]) -> dict[str, Any]:
    """Text values of options that have a parser, parsed (a recipe's "3:5", config.json's)."""
    parsers = {dest(f): meta(f)["type"] for cls in every_option_class() for f in option_fields(cls)
               if meta(f)["type"] is not None}
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, str) and key in parsers:
            try:
                out[key] = parsers[key](value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{key}={value!r}: {e}") from None
    return out


def _check_names(values: Mapping[str, Any], where: str) -> None:
    known = {dest(f) for cls in every_option_class() for f in option_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} "
                         f"{'is not an option' if len(unknown) == 1 else 'are not options'}"
                         "; `ringtrain train --help` lists them (dashes as underscores)")


def check_args(opts: TrainOptions, world_size: int | None = None) -> list[str]:
    """What one section cannot check alone: the machine, the data file, the layout.

    Raises ValueError naming the values and the fix; returns warnings (one line each): what is
    allowed but likely a mistake.

    Args:
        world_size: the job's number of ranks where it is known before the workers start
            (--nnodes N x --nproc-per-node): the strategy's layout and the batch are checked
            against it too. None skips those checks.
    """
    warnings: list[str] = []
    launch, run, t = opts.launch, opts.run, opts.trainer
    cores = os.cpu_count() or 1
    if launch.nproc_per_node > cores:
        warnings.append(f"--nproc-per-node {launch.nproc_per_node} is more than this machine's "
                        f"{cores} CPU cores: the workers take turns on them and every step waits "
                        f"for the slowest; --nproc-per-node {cores} or fewer trains faster")
    # Before any worker starts: NCCL with more processes than GPUs, or CUDA without one.
    choose(launch.backend, launch.device, local_world_size=launch.nproc_per_node,
           gpus=launcher_gpu_count)
    if launch.nnodes != "1" and not (launch.rdzv_endpoint and run.run_dir):
        raise ValueError(f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's "
                         "address) and --run-dir (the same path on every node, so ranks share "
                         "snapshots)")
    if opts.task == "text":
        if run.stop_at_accuracy is not None:
            raise ValueError("--stop-at-accuracy needs the addition task (text has no accuracy); "
                             "drop it or drop --data")
        from ringtrain.cli.job import check_text_data

        train_samples, tokens = check_text_data(opts.data.data, opts.data.block_size, warnings)
    else:
        from ringtrain.data.addition import VOCAB, train_size

        train_samples, tokens = train_size(opts.data.digits), VOCAB
    if run.init_from:  # the shape options against the directory's, before launch
        from ringtrain.formats.init_from import SHAPE, check_shape, source_config

        m = opts.model
        try:  # the data's vocab_size and block_size are checked by the workers (cli/job.py)
            check_shape(source_config(run.init_from), {f.name: getattr(m, f.name)
                        for f in option_fields(m) if f.name in SHAPE}, run.init_from)
        except ValueError as e:  # "n_layer=12" -> "--n-layer 12"
            raise ValueError(to_flags(str(e), every_option_class())) from None
    if t.warmup_steps is not None and t.warmup_steps > t.steps:
        warnings.append(f"--warmup-steps {t.warmup_steps} is more than --steps {t.steps}: "
                        f"the learning rate never reaches --lr {t.lr}; lower --warmup-steps")
    if run.resume_from is not None and run.resume_from > t.steps:
        raise ValueError(f"--resume-from {run.resume_from} is after --steps {t.steps}: a "
                         f"resumed run goes on from its snapshot; use --steps "
                         f"{run.resume_from} or more")
    if run.trace_steps is not None and run.trace_steps.start > t.steps:
        warnings.append(f"--trace-steps {run.trace_steps} starts after the run's last step "
                        f"({t.steps}): the trace will be empty; pick steps up to {t.steps}")
    _check_live(opts, world_size)
    if world_size is not None:
        _check_layout(opts, world_size, train_samples, opts.model.vocab_rows(tokens))
    return warnings


def _check_live(opts: TrainOptions, world_size: int | None) -> None:
    """--live: the strategy's own refusal, and what the live launcher does not do."""
    launch = opts.launch
    if not launch.live:
        if launch.live_wait:
            raise ValueError(f"--live-wait {launch.live_wait:g} needs --live")
        if launch.live_spares:
            raise ValueError(f"--live-spares {launch.live_spares} needs --live (only a live job "
                             "lets a spare take a lost worker's place); add --live or drop it")
        if launch.live_dead_after is not None:
            raise ValueError(f"--live-dead-after {launch.live_dead_after:g} needs --live (it is "
                             "how soon a live job's members find a silent one lost)")
        return
    if launch.live_dead_after == 0:
        raise ValueError("--live-dead-after 0: a worker is lost after that many seconds of "
                         "silence, so it must be more than 0 (its heartbeat comes every "
                         "0.1 s: several beats, e.g. 0.5, keep a busy worker from being taken "
                         "for a lost one)")
    if world_size is not None and world_size < 2:
        raise ValueError("--live needs workers to lose and replace: --nproc-per-node 2 or more")
    refusal = opts.strategy.live_refusal()
    if refusal is not None:
        raise ValueError(f"--live with --strategy {opts.run.strategy}: {refusal}")
    if launch.max_restarts:
        raise ValueError(f"--live with --max-restarts {launch.max_restarts}: the launcher "
                         "replaces a lost worker instead of restarting the job; drop "
                         "--max-restarts (a whole-job failure resumes from the snapshots when "
                         "the same command is run again)")
    if not launch.nnodes.isdigit():
        # Torch's agents would restart every worker when a node joins or leaves the range;
        # live mode replaces workers in place on the nodes the job started with.
        raise ValueError(f"--live with --nnodes {launch.nnodes}: live recovery keeps a fixed "
                         "set of nodes (a lost worker is replaced on its own node, a lost node "
                         "is trained on without); give one number, e.g. --nnodes "
                         f"{launch.nnodes.split(':')[-1]}, or drop --live")


def _check_layout(opts: TrainOptions, world_size: int, train_samples: int,
                  vocab_size: int) -> None:
    """What the workers would otherwise find one by one: a strategy layout that does not fit
    `world_size` or the model of `vocab_size` rows (the strategy's own `plan` and
    `check_model`), a micro-batch larger than one data rank's share of the training set."""
    batch = opts.trainer.batch_size
    data_world_size = opts.strategy.plan(world_size, batch * opts.trainer.grad_accum)
    if opts.task == "text":
        sequence = opts.data.block_size
    else:
        from ringtrain.data.addition import sequence_length

        sequence = sequence_length(opts.data.digits)
    opts.strategy.check_model(opts.model, sequence, vocab_size)
    per_rank = -(-train_samples // data_world_size)  # the sampler pads the last rank's share
    if per_rank < batch:
        raise ValueError(
            f"--batch-size {batch} is more than one data rank's share of the training "
            f"set: {train_samples} samples over {data_world_size} data rank"
            f"{'s' if data_world_size > 1 else ''} is {per_rank} each; use --batch-size "
            f"{per_rank} or less, fewer ranks, or more data")


def tolerated_ranks(opts: TrainOptions, world_size: int | None = None) -> frozenset[int]:
    """Global ranks the job survives losing (the strategy config's `tolerated_ranks`).

    `world_size` defaults to --nnodes x --nproc-per-node; an elastic --nnodes MIN:MAX has no
    fixed layout, so nothing is tolerated there.
    """
    if world_size is None:
        if not opts.launch.nnodes.isdigit():  # elastic --nnodes
            return frozenset()
        world_size = int(opts.launch.nnodes) * opts.launch.nproc_per_node
    return opts.strategy.tolerated_ranks(world_size)


def run_config(opts: TrainOptions, job: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options (besides the trainer's) that must equal a snapshot's to resume from it: the
    fields marked `resume=MUST_MATCH` of the data and model sections, and (given the built
    `job`) the data's tokenizer, which a text edited since would change."""
    out = {name: getattr(opts.data, name) for name in resume_fields(opts.data)}
    out.update({name: getattr(opts.model, name) for name in resume_fields(opts.model)})
    if out["pad_vocab"] == 1:  # as before the option: a snapshot that predates it resumes
        del out["pad_vocab"]
    out["data"] = os.path.abspath(opts.data.data) if opts.data.data else None
    if job is not None:
        from ringtrain.checkpoint.rules import TOKENIZER
        from ringtrain.formats.tokenizer import data_tokenizer, fingerprint

        out[TOKENIZER] = fingerprint(data_tokenizer(job["tokenizer"]))
    return out


def command_line(given: Mapping[str, Any]) -> list[str]:
    """The flags that give config.json's `args` back (those off their default; `ringtrain
    explain` shows it as the resume command), generated from the fields."""
    opts = options_from(given, parse_text=True)
    # The defaults to compare with: the same task, recipe and strategy options (ps async's beta1).
    kept = ["data", "strategy", "recipe", *(dest(f) for f in option_fields(opts.strategy))]
    base = options_from({k: given.get(k) for k in kept}, parse_text=True)
    out: list[str] = []
    defaults = [*base.sections()[:-1], type(opts.strategy)()]  # the strategy's own: its defaults
    for section, default in zip(opts.sections(), defaults, strict=True):
        for f in option_fields(section):
            value = getattr(section, f.name)
            # kept[:3]: data, strategy, recipe
            if value == getattr(default, f.name) and f.name not in kept[:3]:
                continue
            if value is None:
                continue
            if isinstance(value, bool):  # --compile, --no-progress, --bias / --no-bias
                out.append(flag(f) if meta(f)["negatable"] is False or value
                           else "--no-" + flag(f)[2:])
            else:
                out += [flag(f), str(value)]
    return out


def options_table() -> str:
    """docs/train.md's table of options, from the fields (`tests/test_options.py` compares)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    groups = [(title, option_fields(cls), per_task_text) for title, cls in SECTIONS.items()]
    groups += [("--strategy " + ", ".join(names), fields_,
                lambda f, names=names: _default_of(f, names))
               for names, fields_ in strategy_groups()]
    for title, fields_, shown in groups:
        rows.append(f"| **{title}** | | |")
        for f in fields_:
            names = f"{flag(f)}/--no-{flag(f)[2:]}" if meta(f)["negatable"] else flag(f)
            rows.append(f"| `{names}` | {shown(f) or ''} | {meta(f)['help']} |")
    return "\n".join(rows) + "\n"


# ---- the workers' options: RUN_DIR/.options.json, not a rebuilt argv -----------------------------

CONFIG_ENV = "RINGTRAIN_CONFIG"  # the file a launched worker reads its options from
# RUN_DIR's file of them: not config.json, which stays the run's own until a worker's resume
# is accepted (a command refused, for other options, leaves what explain and sample read)
OPTIONS_FILE = ".options.json"


def given_options(parser: argparse.ArgumentParser, argv: list[str], *,
                  launched: bool) -> tuple[dict[str, Any], bool]:
    """What this process was given ({dest: value}) and whether it came from config.json: a
    `launched` worker with `RINGTRAIN_CONFIG` reads the options its launcher checked and wrote;
    any other process (also each task under srun or mpirun, no launcher of ours) parses argv."""
    path = os.environ.get(CONFIG_ENV)
    if path and launched:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["args"], True
    return vars(parser.parse_args(argv)), False


def write_options(opts: TrainOptions) -> str:
    """RUN_DIR/.options.json with the options, atomically, for the workers; left as it is
    when it already holds them (another node of the job wrote it). Returns its path."""
    from ringtrain.training.progress import write_json

    path = os.path.join(opts.run.run_dir, OPTIONS_FILE)
    args = json.loads(json.dumps(opts.flat()))
    try:
        with open(path, encoding="utf-8") as f:
            if json.load(f).get("args") == args:
                return path
    except (OSError, ValueError):
        pass
    os.makedirs(opts.run.run_dir, exist_ok=True)
    write_json(path, {"task": opts.task, "args": args})
    return path
