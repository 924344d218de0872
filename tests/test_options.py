"""An option is defined once (STYLE.md 34): its dataclass field. Nothing else in ringtrain/
spells its flag or lists field names, the parser and config.json come from the fields.

    .venv/bin/pytest -q tests/test_options.py
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

from ringtrain.cli.options import SECTIONS, TASK_DEFAULTS, ModelOptions, every_option_class
from ringtrain.cli.train_args import build_parser, options_from, parse_options
from ringtrain.config.fields import dest, flag, meta, option, option_fields, resume_fields
from ringtrain.models import GPTConfig
from ringtrain.strategies import registered
from ringtrain.training.config import TrainerConfig

PACKAGE = Path(__file__).resolve().parents[1] / "ringtrain"
FIELDS = [f for cls in every_option_class() for f in option_fields(cls)]
FLAGS = {flag(f) for f in FIELDS} | {"--no-bias"}
NAMES = {f.name for f in FIELDS} | {dest(f) for f in FIELDS}


def _constants(tree: ast.AST) -> list[ast.Constant]:
    """String constants, less the `flag=` of an `option(...)` (where a flag is defined) and the
    flags other commands define for themselves (`ringtrain explain --run-dir`: `add_argument`)."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    defining = {id(k.value) for n in calls if getattr(n.func, "id", "") == "option"
                for k in n.keywords if k.arg == "flag"}
    defining |= {id(a) for n in calls if getattr(n.func, "attr", "") == "add_argument"
                 for a in n.args}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in defining]


# ringtrain/launch/ is `ringtrain run`, a command of its own (its flags share some names with
# `ringtrain train`'s, and it knows nothing of training); `ringtrain explain` replays argv.
OTHER_COMMANDS = {PACKAGE / "cli" / "explain.py"}


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if "launch" not in p.parts
                                        and p not in OTHER_COMMANDS),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_flag_is_spelled_and_no_field_names_are_listed_outside_their_field(path):
    tree = ast.parse(path.read_text())
    spelled = [n.value for n in _constants(tree) if n.value in FLAGS]
    assert spelled == [], f"{path}: {spelled}: read the option's field (ringtrain.config) instead"
    for node in ast.walk(tree):  # a second list of options, like the old TRAINING_FIELDS
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 3:
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            listed = len(names) == len(node.elts) and all(n in NAMES for n in names)
            assert not listed, f"{path}:{node.lineno}: {names}: mark the fields instead"
    # A second table of defaults ({"steps": 1000, "lr": 3e-3, ...}) outside TASK_DEFAULTS, the
    # one table of what a task changes: the fields' defaults (or that table) say it already.
    tasks = {id(d) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
             and getattr(n.target, "id", "") == "TASK_DEFAULTS" for d in ast.walk(n.value)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(node.keys) >= 3 and id(node) not in tasks:
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            table = len(keys) == len(node.keys) and all(k in NAMES for k in keys)
            assert not table, f"{path}:{node.lineno}: {keys}: a default belongs to its field"


def test_every_flag_is_unique_and_in_the_help(capsys):
    by_flag: dict[str, set[str]] = {}
    for f in FIELDS:  # a flag two strategies share (--sync-every) is the same field, inherited
        by_flag.setdefault(flag(f), set()).add(f.metadata["option"]["help"])
    assert all(len(helps) == 1 for helps in by_flag.values()), by_flag
    text = build_parser().format_help()
    assert all(f in text for f in FLAGS)


def test_each_option_says_one_default_and_a_turned_off_flag_says_what_it_does():
    """--help once showed `--tp ... (default: 1 with --strategy pipeline, 2 with --strategy
    tp) (--strategy pipeline, tp) (default: 1)` and `--no-resume ... (default: on)`."""
    parser = build_parser()
    for action in parser._actions:  # argparse's list: the generated help of each option
        if action.help and action.option_strings != ["-h", "--help"]:
            assert action.help.count("(default:") <= 1, (action.option_strings, action.help)
    by_flag = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert by_flag["--tp"].endswith("(default: 1 (pipeline) / 2 (tp))")
    assert by_flag["--zero-stage"].endswith("(default: 0 (tp) / 2 (zero))")
    assert by_flag["--no-resume"].endswith("(default: resume from --run-dir's newest committed "
                                           "snapshot)")
    titles = [g.title for g in parser._action_groups]
    assert {"--strategy pipeline, tp", "--strategy tp, zero", "--strategy diloco, localsgd"} <= \
        set(titles)
    for f in FIELDS:  # every default-on bool with a turning-off flag says what happens without it
        if f.default is True and not meta(f)["negatable"]:
            assert not re.search(r"\(default: (on|off)\)", by_flag[flag(f)]), flag(f)
    with pytest.raises(TypeError, match="needs shown="):
        option(True, "draw something", flag="--no-something")


def test_no_strategy_option_is_marked_must_match():
    """Only the data and model sections are compared on resume (`run_config`); a snapshot of
    another strategy or layout resumes through its portable form (--virtual-stages 2 -> 1 does:
    tests/support/resume_pairs.py), so such a mark would promise a check that never runs."""
    for name, cls in registered().items():
        assert resume_fields(cls.Config) == (), name


def test_strategy_config_defaults_are_the_constructors():
    """A strategy built from a script (no config) behaves as one from the command line."""
    for name, cls in registered().items():
        params = inspect.signature(cls.__init__).parameters
        for f in option_fields(cls.Config):
            assert params[f.name].default == f.default, (name, f.name)


def test_config_json_round_trip_for_every_strategy():
    for name in registered():
        opts = parse_options(["--strategy", name])
        again = options_from(json.loads(json.dumps(opts.flat())), parse_text=True)
        assert again == opts, name


def test_the_docs_table_is_the_generated_one():
    from ringtrain.cli.train_args import options_table

    doc = (PACKAGE.parent / "docs" / "train.md").read_text()
    assert options_table() in doc, "regenerate docs/train.md's table (the command is above it)"


def test_a_task_changes_only_what_differs_from_the_fields():
    """A task's default equal to its field's is one default written twice; the two drift."""
    by_name = {f.name: f for cls in SECTIONS.values() for f in option_fields(cls)}
    for task, values in TASK_DEFAULTS.items():
        for name, value in values.items():
            assert name in by_name, f"TASK_DEFAULTS[{task!r}]: {name} is no option"
            assert value != by_name[name].default, \
                f"TASK_DEFAULTS[{task!r}][{name!r}] = {value!r} is the field's default: drop it"
    assert "per_task" not in meta(by_name["steps"])  # which fields a task changes: the table


def test_the_text_task_is_nanogpts_cpu_recipe(tmp_path):
    """Its values come from the fields' defaults and TASK_DEFAULTS["text"] together: a field's
    default that changes changes the preset, and this says so. nanoGPT's README: block 64,
    batch 12, 4 layers x 4 heads x 128, 2000 iterations, dropout 0; its config file: lr 1e-3,
    beta2 0.99."""
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 400)
    o = parse_options(["--data", str(text)])
    assert (o.data.block_size, o.trainer.batch_size, o.model.n_layer, o.model.n_head,
            o.model.n_embd, o.trainer.steps, o.model.dropout, o.trainer.lr, o.trainer.beta2) == \
        (64, 12, 4, 4, 128, 2000, 0.0, 1e-3, 0.99)


def test_the_models_defaults_are_the_models():
    """ModelOptions reads GPTConfig's defaults: `ringtrain train`'s GPT is the library's.
    (pad_vocab is no GPTConfig field: with the data's tokens it makes GPTConfig.vocab_size.)"""
    gpt = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    shape = [f for f in option_fields(ModelOptions) if f.name != "pad_vocab"]
    assert {f.name: f.default for f in shape} == {f.name: gpt[f.name] for f in shape}


def _bad_value(f):
    """A value the field's own rule refuses, or None where it has none (free text)."""
    m = meta(f)
    if isinstance(f.default, bool):
        return "yes"
    if m["choices"]:
        return "nope"
    if getattr(m["type"], "rule", None) == "a positive integer":
        return 0
    if m["type"] is not None:
        return -1 if "int" in str(f.type) else "-1:x"
    return None


CHECKED = [(cls, f) for cls in SECTIONS.values() for f in option_fields(cls)
           if _bad_value(f) is not None]


@pytest.mark.parametrize("cls, f", CHECKED, ids=[f"{c.__name__}.{f.name}" for c, f in CHECKED])
def test_a_config_built_in_python_is_checked_when_built(cls, f):
    """torchtitan's way: `TrainerConfig(steps=0)` fails where it is built, naming the field and
    the value, with the rule the command line's parser applies to the typed flag."""
    bad = _bad_value(f)
    with pytest.raises(ValueError, match=rf"^{f.name}={re.escape(repr(bad))}: "):
        cls(**{f.name: bad})


def test_trainer_config_errors_name_the_field_the_value_and_the_rule():
    cases = {"steps=0: it must be a positive integer$": {"steps": 0},
             r"steps=2\.5: it must be a positive integer$": {"steps": 2.5},
             r"warmup_steps=-1: it must be an integer, 0 or more \(or None\)$":
                 {"warmup_steps": -1},
             r"lr=nan: it must be a finite number, 0 or more$": {"lr": float("nan")},
             r"lr=0\.0: it must be positive$": {"lr": 0.0},
             r"beta2=1\.0: .* must be in \[0, 1\)$": {"beta2": 1.0},
             r"min_lr=0\.5 is above the peak lr \(0\.1\).*lower min_lr": {"lr": 0.1, "min_lr": 0.5},
             r"seed=-1: it must be an integer, 0 or more$": {"seed": -1},
             r"dtype='fp16': use 'fp32' or 'bf16'$": {"dtype": "fp16"},
             r"compile=1: it must be True or False$": {"compile": 1},
             r"steps=None: give a value \(default: 2000\)$": {"steps": None}}
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=f"^{message}"):
            TrainerConfig(**kwargs)
    assert TrainerConfig(grad_clip=None, min_lr=None).resolved().min_lr == 1e-4  # None: derived
    config = TrainerConfig()
    config.lr = 0.0  # set after it was built: resolved() builds its copy, which checks
    with pytest.raises(ValueError, match=r"^lr=0\.0: it must be positive"):
        config.resolved()


@pytest.mark.parametrize("gpus, text, want", [(0, "auto", "cores"), (0, "gpu", None),
                                              (4, "gpu", 4), (4, "auto", 4), (0, "3", 3)])
def test_nproc_per_node_takes_torchruns_gpu_and_auto(monkeypatch, gpus, text, want):
    import os

    import ringtrain.launch.device as device
    from ringtrain.cli.train_args import parse_options

    monkeypatch.setattr(device, "launcher_gpu_count", lambda: gpus)
    if want is None:
        with pytest.raises(SystemExit):
            parse_options(["--nproc-per-node", text])
        return
    got = parse_options(["--nproc-per-node", text]).launch.nproc_per_node
    assert got == (os.cpu_count() if want == "cores" else want)
