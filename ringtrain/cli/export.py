"""`ringtrain export RUN_DIR OUT_DIR --format hf|dcp`: a run's model in another ecosystem's format.

    ringtrain export runs/shakespeare gpt2_dir --format hf     # transformers GPT2LMHeadModel
    ringtrain export runs/shakespeare dcp_dir --format dcp --snapshot 1000

The model is the run's final one (RUN_DIR/model.safetensors), or with `--snapshot STEP` (or
before the run has finished) a committed snapshot's, put together as `ringtrain sample` does
(`cli/sample.py`: a replicated snapshot's model, or per-rank parts joined by the strategy's
converter). The formats are `ringtrain.formats`: `hf` loads with
`GPT2LMHeadModel.from_pretrained(OUT_DIR)`, `dcp` with `torch.distributed.checkpoint.load` on
any world size. `ringtrain train --init-from OUT_DIR` starts a run from either. RUN_DIR may
also be an export (hf <-> dcp), and each export carries the run's tokenizer (formats/tokenizer.py).
A mistake is one message and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ringtrain.config.suggest import suggest_flags
from ringtrain.errors import USAGE_EXIT_CODE

FORMATS = ("hf", "dcp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringtrain export",
                                description="Write a `ringtrain train` run's model as a "
                                            "transformers GPT-2 directory or a torch distributed "
                                            "checkpoint.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="hf: transformers GPT2LMHeadModel (config.json + model.safetensors); "
                        "dcp: torch.distributed.checkpoint")
    p.add_argument("--snapshot", type=int, metavar="STEP",
                   help="the model of this committed snapshot (default: the final model)")
    return suggest_flags(p)


def run_model(run_dir: str, step: int | None):
    """The run's final model (None: unless `step` asks for a snapshot's), eval mode, CPU."""
    from ringtrain.cli.sample import (
        SampleError,
        _is_export,
        _is_run,
        _run_config,
        exported_model,
        snapshot_model,
    )
    from ringtrain.models.export import CONFIG, load_model

    try:
        if os.path.isdir(run_dir) and not _is_run(run_dir) and _is_export(run_dir):
            return exported_model(run_dir, step)[0]  # another export: converted
    except SampleError as e:
        raise ValueError(str(e)) from None
    if step is None and os.path.exists(os.path.join(run_dir, CONFIG)):
        return load_model(run_dir)[0]
    try:
        return snapshot_model(run_dir, step, _run_config(run_dir)["model"],
                              say=lambda m: print(f"ringtrain export: {m}"))
    except SampleError as e:
        raise ValueError(str(e).replace("sample the final model", "export the final model")) \
            from None


def run_tokenizer(run_dir: str) -> dict | None:
    """The tokenizer entry of the run (formats/tokenizer.py): its exported model's, else its
    data's (a run not finished yet); None where neither is found."""
    from ringtrain.cli.sample import SampleError, _run_config, run_data_dir
    from ringtrain.data.tokens import read_meta
    from ringtrain.formats.tokenizer import data_tokenizer, dataset_tokenizer, read_tokenizer

    if (entry := read_tokenizer(run_dir)) is not None:
        return entry
    try:
        config = _run_config(run_dir)
        if config.get("task") == "addition":
            return data_tokenizer(None)
        directory = run_data_dir(run_dir, config["args"]["data"])
        return dataset_tokenizer(directory, read_meta(directory))
    except (SampleError, KeyError, TypeError, ValueError, OSError):
        return None


def _in_the_way(out_dir: str, names: list[str], fmt: str) -> str | None:
    """Why OUT_DIR (holding `names`) cannot take this export, or None: it is new, empty, or an
    earlier export of the same format (replaced: the same names). An export of the other format
    stays in the way: dcp's .metadata beside a new hf export made --init-from and sample read
    the old dcp model, silently; files that are no export are not ours to overwrite."""
    from ringtrain.data.prepare import TOKENIZER_FILE
    from ringtrain.formats import dcp, hf_gpt2
    from ringtrain.models.export import CONFIG

    if not names:
        return None
    other = "dcp" if fmt == "hf" else "hf"
    present = {"hf": hf_gpt2.is_hf_gpt2(out_dir), "dcp": dcp.is_dcp(out_dir)}
    ours = {"hf": (hf_gpt2.CONFIG, hf_gpt2.WEIGHTS, TOKENIZER_FILE),
            "dcp": (dcp.METADATA, CONFIG, TOKENIZER_FILE)}[fmt]
    foreign = [n for n in names if n not in ours and not (fmt == "dcp" and n.endswith(".distcp"))]
    if present[other]:
        why = (f"{'an hf' if other == 'hf' else 'a dcp'} export: one directory of two models "
               "is read as one or the other by reader (--init-from and sample take the dcp one, "
               "transformers the hf one)")
    elif not present[fmt] or foreign:
        why = "not an earlier ringtrain export of this format"
    else:
        return None
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"OUT_DIR {out_dir} is not empty ({shown}: {why}); give a new or empty directory, "
            f"or an earlier --format {fmt} export's, which is replaced")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ringtrain.formats.dcp import export_dcp
    from ringtrain.formats.hf_gpt2 import export_hf

    if os.path.abspath(args.out_dir) == os.path.abspath(args.run_dir):
        print(f"ringtrain export: OUT_DIR is RUN_DIR ({args.run_dir}); give another directory",
              file=sys.stderr)
        return USAGE_EXIT_CODE
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        print(f"ringtrain export: OUT_DIR {args.out_dir} is a file, not a directory; give a "
              "directory (created if missing)", file=sys.stderr)
        return USAGE_EXIT_CODE
    there = sorted(os.listdir(args.out_dir)) if os.path.isdir(args.out_dir) else []
    if (in_the_way := _in_the_way(args.out_dir, there, args.format)) is not None:
        print(f"ringtrain export: {in_the_way}", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        model = run_model(args.run_dir, args.snapshot)
    except (ValueError, FileNotFoundError) as e:
        print(f"ringtrain export: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    from ringtrain.formats.tokenizer import portable

    try:
        os.makedirs(args.out_dir, exist_ok=True)
        tokenizer = portable(run_tokenizer(args.run_dir), args.out_dir)  # init-from checks it
        paths = (export_hf if args.format == "hf" else export_dcp)(model, args.out_dir, tokenizer)
    except OSError as e:  # OUT_DIR a file, not writable, a full disk
        print(f"ringtrain export: cannot write OUT_DIR {args.out_dir}: {e.strerror or e} "
              f"({e.filename or args.out_dir}); give a directory you can write", file=sys.stderr)
        return USAGE_EXIT_CODE
    copied = [tokenizer["file"]] if tokenizer and "file" in tokenizer else []  # a BPE's
    names = list(dict.fromkeys([*map(os.path.basename, paths), *copied]))
    replaced = f" (replacing the {args.format} export there)" if there else ""
    print(f"wrote {args.format} to {args.out_dir}{replaced}: {', '.join(names)}")
    return 0
