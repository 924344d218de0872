"""`ringtrain sample RUN_DIR`: generate text with a trained run's model (nanoGPT's sample.py).

    ringtrain sample runs/shakespeare --prompt "ROMEO:" --tokens 200 --temperature 0.8 --top-k 40
    ringtrain sample runs/shakespeare --snapshot 1000          # the model of step 1000's snapshot

The final model is RUN_DIR/model.safetensors + model_config.json (`ringtrain train` exports
them at the end); `--snapshot STEP` (or a run that has not finished) reads a committed snapshot
instead. A snapshot of a replicated strategy (ddp, localsgd, diloco) holds the whole model; one
written as per-rank parts (zero, pipeline, tp, ps) is put together by its strategy's own
converter (`Strategy.to_portable`, what a resume in another layout reads). The tokenizer is the
run's own: the exported one, else the prepared dataset's (RUN_DIR/data for a .txt). A run of
the addition task answers sums instead: held-out ones, or the one in --prompt. A mistake (no
such run, snapshot or character) is one message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringtrain.config.suggest import suggest_flags
from ringtrain.errors import USAGE_EXIT_CODE


class SampleError(ValueError):
    """What `ringtrain sample` cannot do, with the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain sample",
                                description="Generate text with the model of a "
                                            "`ringtrain train` run, or of an export of one.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `ringtrain train` run directory, or "
                   "`ringtrain export`'s hf or dcp directory")
    p.add_argument("--prompt", help="the text to continue (default: a newline, or the first "
                   "character of a vocabulary without one); the addition "
                   "task: a sum, e.g. 12+34 (default: held-out sums)")
    p.add_argument("--tokens", type=int, default=200, metavar="N",
                   help="tokens to generate (default: 200; the addition task answers greedily "
                   "with the sum's digits, whatever --tokens, --temperature and --top-k say)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="below 1 sharper, above 1 more random, 0 greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="sample among the K likeliest tokens, 0: all (default: 200)")
    p.add_argument("--snapshot", type=int, metavar="STEP",
                   help="the model of this committed snapshot (default: the exported final model)")
    p.add_argument("--num-samples", type=int, metavar="N",
                   help="samples to draw (default: 1; the addition task without --prompt: 5 "
                   "held-out sums)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (default: 1337)")
    return suggest_flags(p)


def _run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise SampleError(f"{run_dir}: no such directory; give the directory of a `ringtrain "
                          "train` run (its --run-dir, runs/<timestamp> by default)")
    if not os.path.exists(path):
        raise SampleError(f"{run_dir}: no config.json; give the directory of a "
                          "`ringtrain train` run, or an export of one")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SampleError(f"{path}: cannot read it ({e})") from None
    if not isinstance(config, dict) or not {"args", "model"} <= set(config):
        raise SampleError(f"{path} is not the config.json of a `ringtrain train` run (it needs "
                          "args and model); give the directory of one, or an export of one")
    return config


def snapshot_model(run_dir: str, step: int | None, model_config: dict[str, Any],
                   say: Callable[[str], None] | None = None):
    """The GPT of the committed snapshot of `step` (None: the newest, named through `say`: the
    user asked for the final model and gets the run's newest), eval mode."""
    import torch

    from ringtrain.checkpoint.files import (
        SHARED,
        SnapshotError,
        read_manifest,
        snap_dirs,
        unwrap_state_dict,
        verify,
    )
    from ringtrain.checkpoint.rules import TOKENIZER
    from ringtrain.models import GPT, GPTConfig
    from ringtrain.models.export import state_to_model

    dirs = snap_dirs(Path(run_dir) / "snapshots")
    committed = {}
    for p in dirs:
        try:
            committed[int(p.name[5:])] = (p, read_manifest(p))
        except SnapshotError:
            continue
    if not committed:
        what = ("no committed snapshot" if step is not None
                else "no exported model and no committed snapshot")
        raise SampleError(f"{run_dir}: {what}; wait for the run to finish or to save one "
                          "(--snapshot-every)")
    if step is None and say is not None:
        say(f"{run_dir} has not finished (no final model yet): the model of its newest committed "
            f"snapshot, step {max(committed)} (--snapshot STEP for another)")
    step = max(committed) if step is None else step
    if step not in committed:
        raise SampleError(f"{run_dir}: no committed snapshot of step {step}; committed: "
                          f"{sorted(committed)}")
    path, manifest = committed[step]
    meta = manifest["metadata"]
    _same_data_tokenizer(run_dir, step, meta.get("config", {}).get(TOKENIZER))
    strategy = meta.get("topology", {}).get("strategy", "?")
    try:
        verify(path, manifest, [SHARED])
    except SnapshotError as e:
        raise SampleError(f"snapshot of step {step}: {e}") from None
    shared = torch.load(path / SHARED, map_location="cpu", weights_only=True)
    if not meta.get("replicated"):
        model = GPT(GPTConfig(**model_config))
        _load_parts(model, path, manifest, step, strategy, shared)
        return model.eval()
    return state_to_model(unwrap_state_dict(shared["strategy"]["model"]), model_config)


def _same_data_tokenizer(run_dir: str, step: int, recorded: str | None) -> None:
    """A run not finished reads its data's tokenizer (`tokenizer_of`, export's `run_tokenizer`):
    it must be the one the snapshot recorded, or a SampleError. A --data DIR prepared again
    since from other text gives its ids other meanings: sample decoded them as other text, or
    died of an IndexError, and export wrote that tokenizer beside the model."""
    from ringtrain.data.tokens import read_meta
    from ringtrain.formats.tokenizer import dataset_tokenizer, fingerprint
    from ringtrain.models.export import CONFIG

    data = _run_config(run_dir)["args"].get("data")
    if recorded is None or not data or os.path.exists(os.path.join(run_dir, CONFIG)):
        return  # an older snapshot, the addition task, or the run's exported tokenizer is read
    directory = run_data_dir(run_dir, data)
    try:
        now = fingerprint(dataset_tokenizer(directory, read_meta(directory)))
    except (ValueError, OSError, KeyError):
        return  # unreadable: `tokenizer_of` says so
    if now != recorded:
        raise SampleError(
            f"the snapshot of step {step} of {run_dir} was trained on data tokenized as "
            f"{recorded}, and {directory} is now {now} (prepared again since, from other "
            "text): its token ids would read as other text. Prepare the data as it was, or "
            "wait for the run's end (its final model keeps its tokenizer)")


def _load_parts(model, path: Path, manifest: dict[str, Any], step: int, strategy: str,
                shared: dict[str, Any]) -> None:
    """Load the model of a snapshot written as per-rank parts (zero, pipeline, tp, ps): the
    saving strategy's own converter joins them (`Strategy.to_portable`, what a resume in another
    layout reads), one rank's file at a time where it can."""
    from ringtrain.checkpoint.files import Snapshot, SnapshotError
    from ringtrain.checkpoint.sharded import load_strategy_parts
    from ringtrain.strategies import portable, registered

    snap = Snapshot(path, step, manifest)
    source = registered().get(strategy)
    try:
        state = None if source is None else source.to_portable(
            lambda ranks: load_strategy_parts(snap, ranks), shared.get("strategy"),
            manifest["metadata"])
        if state is None:
            raise ValueError(f"--strategy {strategy} has no converter to the layout-free form")
        portable.load_model(model, state["model"])
    except (KeyError, ValueError, SnapshotError) as e:
        raise SampleError(f"the snapshot of step {step} (--strategy {strategy}, per-rank parts) "
                          f"cannot be put together: {e}; sample the final model instead (drop "
                          "--snapshot)") from None


def run_data_dir(run_dir: str, data: str) -> str:
    """The prepared directory a run of `--data data` read: `data` itself, or (a text file) its
    char-level copy in RUN_DIR/data (`ringtrain.data.tokens.prepare_text_in`)."""
    return data if os.path.isdir(data) else os.path.join(run_dir, "data")


def _tokenizer(entry: dict[str, Any], base: str):
    """The tokenizer of a char or bpe entry (formats/tokenizer.py); a BPE's file is relative to
    `base` (or absolute)."""
    from ringtrain.data.tokens import BPETokenizer, CharTokenizer

    if entry["type"] == "char":
        return CharTokenizer(entry["chars"])
    return BPETokenizer(os.path.join(base, entry["file"]))


def tokenizer_of(run_dir: str, config: dict[str, Any], exported: dict[str, Any] | None):
    """The run's tokenizer (`encode`, `decode`, `vocab_size`)."""
    from ringtrain.data.tokens import read_meta
    from ringtrain.formats.tokenizer import dataset_tokenizer

    entry = exported["tokenizer"] if exported else None
    if entry is None and config["args"].get("data"):  # not exported yet: the dataset's own
        directory = run_data_dir(run_dir, config["args"]["data"])
        try:
            entry = dataset_tokenizer(directory, read_meta(directory))
        except (ValueError, OSError) as e:
            raise SampleError(f"{run_dir}: cannot find the run's tokenizer ({e})") from None
    if entry is None or entry["type"] not in ("char", "bpe"):
        raise SampleError(f"{run_dir}: the run exported no tokenizer and has no --data")
    return _tokenizer(entry, run_dir)


def sums(model, digits: int, prompt: str | None, count: int | None) -> list[str]:
    """The addition task's samples: the sum in `prompt` ('12+34', or '1234' as the model reads
    it) or `count` held-out ones (default 5), each as the model answers it ('12+34=46 ok')."""
    from ringtrain.data.addition import AdditionDataset, answer

    if prompt is None:
        pairs = AdditionDataset("test", digits).pairs[:count or 5]
        return [answer(model, a, b, digits) for a, b in pairs]
    # As the samples print it ('12+34=46 ok'): a copied '12+34=' or '12 + 34' is the same sum.
    text = prompt.replace(" ", "").removesuffix("=")
    a, plus, b = text.partition("+")
    if not plus and len(text) == 2 * digits:  # the operands as the model reads them
        a, b = text[:digits], text[digits:]
    if not all(x.isascii() and x.isdigit() and len(x) <= digits for x in (a, b)):
        example = "".join(str(i % 10 + 1) for i in range(2 * digits))
        raise SampleError(f"--prompt {prompt!r}: this run adds numbers of up to {digits} "
                          f"digits; give a sum, e.g. --prompt {example[:digits]}+"
                          f"{example[digits:]} (or {example}, both operands zero-padded)")
    return [answer(model, int(a), int(b), digits)]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        for text in generate(args):
            print(text, flush=True)
    except SampleError as e:
        print(f"ringtrain sample: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0


def _is_run(path: str) -> bool:
    """Whether `path` is a `ringtrain train` run directory (its config.json has the run's args),
    not an export (`ringtrain export`'s hf or dcp directory)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return "args" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def _is_export(path: str) -> bool:
    from ringtrain.formats.hf_gpt2 import FormatError
    from ringtrain.formats.init_from import detect

    try:
        return bool(detect(path))
    except FormatError:
        return False


def exported_model(path: str, snapshot: int | None):
    """(model, tokenizer or None, digits) of an export: `ringtrain export`'s hf or dcp
    directory, read as `--init-from` reads it, with the tokenizer it records."""
    from dataclasses import asdict

    from ringtrain.data.addition import sequence_length
    from ringtrain.formats.hf_gpt2 import FormatError
    from ringtrain.formats.init_from import read_weights
    from ringtrain.formats.tokenizer import read_tokenizer
    from ringtrain.models.export import state_to_model

    if snapshot is not None:
        raise SampleError(f"--snapshot {snapshot}: {path} is an export (one model); give the run "
                          "directory for its snapshots")
    try:
        config, state = read_weights(path)
    except (FormatError, ValueError, OSError) as e:
        raise SampleError(f"{path}: cannot read its model ({e})") from None
    entry = read_tokenizer(path)
    if config is None or entry is None:
        raise SampleError(f"{path}: records no {'model shape' if config is None else 'tokenizer'}"
                          " (not written by `ringtrain export`); sample the run it came from")
    model = state_to_model(state, asdict(config))
    if entry["type"] == "digits":
        digits = next((d for d in range(1, 20) if sequence_length(d) == config.block_size), None)
        if digits is None:
            raise SampleError(f"{path}: an addition model of {config.block_size} positions, no "
                              "number of digits fits; sample the run it came from")
        return model, None, digits
    return model, _tokenizer(entry, path), None


def _default_prompt(tok) -> str:
    """A newline (nanoGPT's start), or where the text had none (a character vocabulary without
    it) the vocabulary's first character: a sample without --prompt never fails."""
    try:
        tok.encode("\n")
    except ValueError:
        return tok.decode([0])
    return "\n"


def generate(args: argparse.Namespace) -> list[str]:
    """The samples `args` asks for, each the prompt and its continuation."""
    import torch

    from ringtrain.models.export import load_model, read_config

    bad = [f"{flag} {value}: it must be {rule}" for flag, value, low, rule in (
        ("--tokens", args.tokens, 1, "1 or more"),
        ("--num-samples", args.num_samples, 1, "1 or more"),
        ("--temperature", args.temperature, 0, "0 or more (0: the likeliest token each time)"),
        ("--top-k", args.top_k, 0, "0 or more (0: every token)")) if value is not None and (
            value < low or value != value)]  # value != value: a NaN temperature
    if bad:
        raise SampleError("; ".join(bad))
    if os.path.isdir(args.run_dir) and not _is_run(args.run_dir) and _is_export(args.run_dir):
        model, tok, digits = exported_model(args.run_dir, args.snapshot)
        if digits is not None:
            return sums(model, digits, args.prompt, args.num_samples)
    else:
        config = _run_config(args.run_dir)
        exported = None
        if os.path.exists(os.path.join(args.run_dir, "model_config.json")):
            exported = read_config(args.run_dir)
        if args.snapshot is None and exported is not None:
            model, _ = load_model(args.run_dir)
        else:
            model = snapshot_model(args.run_dir, args.snapshot, config["model"],
                                   say=lambda m: print(f"ringtrain sample: {m}", file=sys.stderr))
        if not config["args"].get("data"):
            return sums(model, int(config["args"]["digits"]), args.prompt, args.num_samples)
        tok = tokenizer_of(args.run_dir, config, exported)
    try:
        ids = tok.encode(_default_prompt(tok) if args.prompt is None else args.prompt)
    except ValueError as e:
        raise SampleError(f"--prompt: {e}") from None
    if not ids:
        raise SampleError("--prompt encodes to no tokens; give some text")
    g = torch.Generator().manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long)
    out = []
    for _ in range(args.num_samples or 1):
        y = model.generate(x, args.tokens, temperature=args.temperature,
                           top_k=args.top_k or None, generator=g, vocab=tok.vocab_size)
        out.append(tok.decode(y[0].tolist()))
    return out
