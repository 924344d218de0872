"""An unknown flag's error names the flag meant (`ringtrain.config.suggest`), in every command.

    .venv/bin/pytest -q tests/test_flag_hints.py

In-process: each command's parser as its main builds it; nothing starts.
"""

from __future__ import annotations

import argparse

import pytest

from ringtrain.cli import explain, export, plan, prepare, sample, train_args
from ringtrain.config.suggest import OTHER_TOOLS, hint, suggest_flags
from ringtrain.launch.run_args import get_args_parser


def _error(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"{parser.prog}: error: unrecognized arguments: ")
    return err


@pytest.mark.parametrize("argv,said", [
    (["--stpes", "10"], "--stpes: did you mean --steps?"),
    (["--n-layers=4"], "--n-layers: did you mean --n-layer?"),
    (["--max-steps", "5"], "--max-steps: did you mean --steps?"),
    (["--nprocs", "2"], "--nprocs: did you mean --nproc-per-node?"),
    (["--resume"], "--resume: resuming is the default: `ringtrain train` resumes from "
                   "--run-dir's newest committed snapshot (--resume-from STEP goes back to an "
                   "earlier one, --no-resume starts afresh)"),
    (["--epochs", "3"], "--epochs: ringtrain train counts optimizer steps: --steps"),
    (["--local_rank", "0"], "--local_rank: not needed: every worker reads LOCAL_RANK"),
    (["--world-size", "4"], "--world-size: use --nproc-per-node and --nnodes"),
    (["--gpus", "8"], "--gpus: use --nproc-per-node (one process per GPU)"),
    # No abbreviations (a new flag would change what one means): the flags it begins.
    (["--nproc", "2"], "--nproc: did you mean --nproc-per-node?"),
    (["--snapshot", "5"], "--snapshot: did you mean --snapshot-every?"),
    (["--live-d", "1"], "--live-d: did you mean --live-dead-after?"),
])
def test_train_names_the_flag_meant(argv, said, capsys):
    err = _error(train_args.build_parser(), argv, capsys)
    assert f"unrecognized arguments: {' '.join(argv)}; {said}" in err, err


def test_every_other_tools_flag_is_hinted_by_train():
    parser = train_args.build_parser()
    assert all(hint(parser, name) for name in OTHER_TOOLS)  # a renamed flag fails here


def test_two_unknown_flags_get_a_hint_each(capsys):
    err = _error(train_args.build_parser(), ["--stpes", "3", "--bach-size", "8"], capsys)
    assert err.endswith("; --stpes: did you mean --steps?; --bach-size: did you mean "
                        "--batch-size or --eval-batch-size?"), err  # two at most


def test_run_offers_one_spelling_and_says_where_a_scripts_flag_goes(capsys):
    parser = get_args_parser()
    err = _error(parser, ["--nprocs-per-node", "2", "train.py"], capsys)
    assert err.endswith("; --nprocs-per-node: did you mean --nproc-per-node?"), err  # not also _
    # --epochs before the script: run has no --steps to offer, and the flag was the script's
    err = _error(parser, ["--epochs", "train.py"], capsys)
    assert err.endswith("; a flag of your script goes after the script's name (ringtrain run "
                        "[flags of run] SCRIPT [flags of SCRIPT])"), err
    assert parser.parse_args(["train.py", "--epochs", "3"]).training_script_args == [
        "--epochs", "3"]  # after the script: the script's, as always


@pytest.mark.parametrize("parser,argv,said", [
    (sample.build_parser(), ["RUN", "--temprature", "0.5"], "--temperature"),
    (plan._parser(), ["--n-layers", "4"], "--n-layer"),
    (prepare.build_parser(), ["in.txt", "out", "--val-fractoin", "0.2"], "--val-fraction"),
    (export.build_parser(), ["RUN", "OUT", "--format", "hf", "--snapshto", "4"], "--snapshot"),
])
def test_every_command_hints(parser, argv, said, capsys):
    err = _error(parser, argv, capsys)
    assert err.endswith(f"did you mean {said}?"), err


def test_nothing_close_leaves_argparses_message(capsys):
    assert explain.main(["RUN", "--verbose"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "ringtrain explain: error: unrecognized arguments: --verbose"
    bare = suggest_flags(argparse.ArgumentParser(prog="p"))
    bare.add_argument("--steps")
    assert hint(bare, "--resume") is None  # offers --run-dir, which this parser lacks
    assert hint(bare, "-x") is None and hint(bare, "value") is None
