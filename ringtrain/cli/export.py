"""`ringtrain export RUN_DIR OUT_DIR --format hf|dcp`: a run's model in another ecosystem's format.

    ringtrain export runs/shakespeare gpt2_dir --format hf     # transformers GPT2LMHeadModel
    ringtrain export runs/shakespeare dcp_dir --format dcp --snapshot 1000

The model is the run's final one (RUN_DIR/model.safetensors), or with `--snapshot STEP` (or
before the run has finished) a committed snapshot's, put together as `ringtrain sample` does
(`cli/sample.py`: a replicated snapshot's model, or per-rank parts joined by the strategy's
converter). The formats are `ringtrain.formats`: `hf` loads with
`GPT2LMHeadModel.from_pretrained(OUT_DIR)`, `dcp` with `torch.distributed.checkpoint.load` on
any world size. `ringtrain train --init-from OUT_DIR` starts a run from either. A mistake is
one message and exit code 2.
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
    from ringtrain.cli.sample import SampleError, _run_config, snapshot_model
    from ringtrain.models.export import CONFIG, load_model

    if step is None and os.path.exists(os.path.join(run_dir, CONFIG)):
        return load_model(run_dir)[0]
    try:
        return snapshot_model(run_dir, step, _run_config(run_dir)["model"])
    except SampleError as e:
        raise ValueError(str(e).replace("sample the final model", "export the final model")) \
            from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ringtrain.formats.dcp import export_dcp
    from ringtrain.formats.hf_gpt2 import export_hf

    if os.path.abspath(args.out_dir) == os.path.abspath(args.run_dir):
        print(f"ringtrain export: OUT_DIR is RUN_DIR ({args.run_dir}); give another directory",
              file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        model = run_model(args.run_dir, args.snapshot)
    except (ValueError, FileNotFoundError) as e:
        print(f"ringtrain export: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    paths = (export_hf if args.format == "hf" else export_dcp)(model, args.out_dir)
    print(f"wrote {args.format} to {args.out_dir}: {', '.join(map(os.path.basename, paths))}")
    return 0
