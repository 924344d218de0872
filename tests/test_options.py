"""An option is defined once (STYLE.md 34): its dataclass field. Nothing else in ringtrain/
spells its flag or lists field names, the parser and config.json come from the fields.

    .venv/bin/pytest -q tests/test_options.py
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from ringtrain.cli.options import every_option_class
from ringtrain.cli.train_args import build_parser, options_from, parse_options
from ringtrain.config.fields import dest, flag, option_fields
from ringtrain.strategies import registered

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


def test_every_flag_is_unique_and_in_the_help(capsys):
    by_flag: dict[str, set[str]] = {}
    for f in FIELDS:  # a flag two strategies share (--sync-every) is the same field, inherited
        by_flag.setdefault(flag(f), set()).add(f.metadata["option"]["help"])
    assert all(len(helps) == 1 for helps in by_flag.values()), by_flag
    text = build_parser().format_help()
    assert all(f in text for f in FLAGS)


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
