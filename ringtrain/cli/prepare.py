"""`ringtrain prepare SRC OUT_DIR`: a text file or folder of text files -> a token dataset.

    ringtrain prepare input.txt data/shakespeare
    ringtrain prepare corpus/ data/corpus --tokenizer bpe --vocab-size 4096 --val-fraction 0.05
    ringtrain train --data data/corpus --block-size 128
    ringtrain prepare more.txt data/more --tokenizer-from runs/x   # continue runs/x's model on it:
    ringtrain train --data data/more --init-from runs/x

What it writes and how (streaming, bounded memory): `ringtrain.data.prepare`. A mistake (no
files, text that is not UTF-8, an empty text, a vocabulary larger than the data supports) is
one message and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ringtrain.config.suggest import suggest_flags
from ringtrain.errors import USAGE_EXIT_CODE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringtrain prepare",
        description="Tokenize a UTF-8 text file or a folder of them into OUT_DIR: train.bin, "
        "val.bin (uint16 or uint32 token ids, np.memmap-able), meta.json and, for BPE, "
        "tokenizer.json. Then: ringtrain train --data OUT_DIR.")
    p.add_argument("src", metavar="SRC", help="a UTF-8 text file, or a folder of them (sorted, "
                   "recursive, hidden files skipped)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the dataset goes (created)")
    p.add_argument("--tokenizer", choices=("char", "bpe"),
                   help="char: every distinct character; bpe: byte-level BPE trained here on the "
                   "training split (needs `tokenizers`) (default: char)")
    p.add_argument("--tokenizer-from", metavar="DIR",
                   help="encode with the tokenizer of DIR instead of making one: a prepared "
                   "dataset, a `ringtrain train` run, or an export of one (`ringtrain export`), "
                   "so that `ringtrain train --init-from DIR` can continue on this text")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="BPE vocabulary, 256 or more (default: 4096)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="the end of the text held out for validation (default: 0.1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return suggest_flags(p)


def tokenizer_from(path: str) -> dict:
    """The tokenizer entry (formats/tokenizer.py) of a prepared dataset, a run directory or an
    export, with "source": `path`; a PrepareError where `path` records none."""
    from ringtrain.data.prepare import META, PrepareError
    from ringtrain.data.tokens import read_meta
    from ringtrain.formats.tokenizer import dataset_tokenizer, read_tokenizer

    if not os.path.isdir(path):
        raise PrepareError(f"--tokenizer-from {path}: no such directory")
    try:
        entry = (dataset_tokenizer(path, read_meta(path)) if os.path.exists(
            os.path.join(path, META)) else read_tokenizer(path))
    except (ValueError, KeyError) as e:
        raise PrepareError(f"--tokenizer-from {path}: cannot read its tokenizer ({e})") from None
    if entry is None:
        raise PrepareError(f"--tokenizer-from {path}: records no tokenizer; give a prepared "
                           "dataset (meta.json), a finished `ringtrain train` run directory, or "
                           "an export of one (ringtrain export RUN_DIR OUT --format hf|dcp)")
    return {**entry, "source": path}


def _earlier_preparation(out_dir: str) -> str | None:
    """What OUT_DIR holds already, in words ("of words.txt, 154,482 train tokens"), or None.
    `ringtrain prepare` replaces it: said, since runs trained on it resume on it only."""
    import json

    from ringtrain.data.tokens import META

    try:
        with open(os.path.join(out_dir, META), encoding="utf-8") as f:
            meta = json.load(f)
        names = ", ".join(os.path.basename(p) for p in meta["sources"][:3])
        more = len(meta["sources"]) - 3
        return (f"of {names}{f' and {more} more' if more > 0 else ''}, "
                f"{meta['train_tokens']:,} train tokens")
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one of ours: nothing said
        return None


def main(argv: list[str] | None = None) -> int:
    from ringtrain.data.prepare import PrepareError, prepare

    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    earlier = _earlier_preparation(args.out_dir)
    from ringtrain.cli.dir_contents import holds

    if (kind := holds(args.out_dir)) not in (None, "a prepared dataset"):
        print(f"ringtrain prepare: error: OUT_DIR {args.out_dir} holds {kind}, not a dataset, "
              "and the dataset's files would go among its files. Give the dataset a directory "
              "of its own (e.g. data/NAME)", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        reuse = tokenizer_from(args.tokenizer_from) if args.tokenizer_from else None
        if reuse is not None and (args.tokenizer or args.vocab_size):
            raise PrepareError("--tokenizer-from takes the tokenizer and its vocabulary from "
                               f"{args.tokenizer_from}; drop --tokenizer and --vocab-size")
        meta = prepare(args.src, args.out_dir, tokenizer=args.tokenizer or "char",
                       vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                       progress=not args.no_progress, reuse=reuse)
    except PrepareError as e:
        print(f"ringtrain prepare: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C: an earlier dataset stays whole up to the last renames
        kept = (f"{args.out_dir} holds the dataset prepared there before ({earlier})" if earlier
                and earlier == _earlier_preparation(args.out_dir)
                else f"{args.out_dir} holds no finished dataset")
        print(f"ringtrain prepare: interrupted; {kept}", file=sys.stderr)
        return 130
    except OSError as e:  # a write that failed after the checks (a full disk): one line
        print(f"ringtrain prepare: error: writing {args.out_dir}: {e.strerror or e} "
              f"({e.filename or args.out_dir})", file=sys.stderr)
        return 1
    if earlier and earlier != _earlier_preparation(args.out_dir):  # not the same text again
        print(f"{args.out_dir}: replaced the dataset prepared there before ({earlier})")
    print(f"{args.out_dir}: {meta['tokenizer']} vocabulary of {meta['vocab_size']}, "
          f"{meta['train_tokens']:,} train and {meta['val_tokens']:,} validation tokens "
          f"({meta['dtype']}) from {meta['characters']:,} characters in "
          f"{len(meta['sources'])} file{'s' if len(meta['sources']) > 1 else ''}; "
          f"train with: ringtrain train --data {args.out_dir}")
    return 0
