"""`ringtrain prepare`: a text file or a folder of text files -> a token dataset on disk.

    ringtrain prepare input.txt data/shakespeare                           # characters
    ringtrain prepare corpus/ data/corpus --tokenizer bpe --vocab-size 4096   # byte-level BPE

The output directory holds, as nanoGPT's `prepare.py` writes them:

    train.bin, val.bin   token ids, raw little-endian uint16 (vocabulary <= 65,536) or uint32;
                         `np.memmap(path, dtype=meta["dtype"], mode="r")` reads them
    tokenizer.json       the trained BPE (Hugging Face `tokenizers`); char level: in meta.json
    meta.json            written last (a directory without it is unfinished): tokenizer, vocab,
                         dtype, token counts, the sources and the split

The split is by characters, as `ringtrain train --data FILE.txt` always did: the first
1 - val_fraction of the text (files in sorted order, one after the other) is for training, the
rest for validation. The BPE is trained on the training split only, locally (nothing is
downloaded).

Streaming: the text is read in chunks of `chunk_chars` characters, three passes at most (count
and scan the characters; train the BPE; encode), so memory is bounded by the chunk, the
vocabulary and the BPE trainer's word counts, not by the corpus. torch is not needed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "ringtrain-tokens"
VAL_FRACTION = 0.1
CHUNK_CHARS = 1 << 20  # characters read at a time: the unit of memory use
MIN_BPE_VOCAB = 256  # a byte-level BPE starts from the 256 bytes


class PrepareError(ValueError):
    """Input `prepare` cannot turn into a dataset; the message says what and the fix."""


def source_files(src: str) -> list[str]:
    """The text files of `src`: itself, or a folder's regular files (sorted, recursive, no
    hidden ones)."""
    if not os.path.exists(src):
        raise PrepareError(f"{src}: no such file or directory; give a UTF-8 text file or a folder "
                           "of them")
    if not os.path.isdir(src):
        return [src]
    files = []
    for root, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise PrepareError(f"{src}: the folder holds no files; put UTF-8 text files in it")
    return files


def read_chunks(files: list[str], chunk_chars: int = CHUNK_CHARS, *,
                whole_lines: bool = False) -> Iterator[str]:
    """The files' text, one after the other, in chunks of about `chunk_chars` characters.

    A file that does not end with a newline gets one before the next file. `whole_lines`: cut
    chunks after a newline (or, on a line longer than a chunk, after a space) so a BPE never
    sees a word split in two. Raises PrepareError for text that is not UTF-8.
    """
    for n, path in enumerate(files):
        last = ""
        carry = ""
        try:
            # newline=None, as `--data FILE.txt` always read
            with open(path, encoding="utf-8") as f:
                while True:
                    piece = f.read(chunk_chars)
                    if not piece:
                        break
                    last = piece[-1]
                    text = carry + piece
                    carry = ""
                    if whole_lines:
                        cut = text.rfind("\n") + 1 or text.rfind(" ") + 1
                        if 0 < cut < len(text):
                            text, carry = text[:cut], text[cut:]
                    yield text
        except UnicodeDecodeError as e:
            bad = bytes(e.object[e.start:e.start + 1])
            raise PrepareError(f"{path}: not UTF-8 text (byte {bad!r}: {e.reason}); convert it "
                               "to UTF-8 first, e.g. `iconv -f latin1 -t utf-8`") from None
        if carry:
            yield carry
        if last and last != "\n" and n + 1 < len(files):
            yield "\n"


def _split(chunks: Iterator[str], n_train: int) -> Iterator[tuple[str, str]]:
    """(train part, val part) of each chunk, where the split falls after `n_train` characters."""
    seen = 0
    for text in chunks:
        cut = min(len(text), max(0, n_train - seen))
        seen += len(text)
        yield text[:cut], text[cut:]


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _Bar:
    """A tqdm bar over characters on a terminal; elsewhere (a log file) one line per pass, at
    its end, instead of a redraw per second. Nothing when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool, unit: str = "char"):
        self.bar, self.desc, self.n, self.started = None, desc, 0, time.perf_counter()
        self.unit = unit
        self.plain = enabled and not sys.stderr.isatty()
        if enabled and not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, mininterval=0.5)

    def update(self, n: int) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self, finished: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain and finished:  # a pass that failed says its error, not a count
            print(f"{self.desc}: {self.n:,} {self.unit}s in "
                  f"{time.perf_counter() - self.started:.1f} s",
                  file=sys.stderr, flush=True)


def _scan(files: list[str], chunk_chars: int, progress: bool) -> tuple[int, set[str]]:
    total_bytes = sum(os.path.getsize(f) for f in files)
    bar = _Bar(total_bytes, "scan", progress, unit="byte")
    n, chars = 0, set()
    try:
        for text in read_chunks(files, chunk_chars):
            n += len(text)
            chars.update(text)
            bar.update(len(text.encode("utf-8")))
    except BaseException:
        bar.close(finished=False)
        raise
    bar.close()
    return n, chars


def _train_bpe(files: list[str], n_train: int, vocab_size: int, chunk_chars: int):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise PrepareError("--tokenizer bpe needs Hugging Face `tokenizers`: pip install "
                           "'ringtrain[tokens]' (or pip install tokenizers)") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chunks = (train for train, _ in _split(read_chunks(files, chunk_chars, whole_lines=True),
                                           n_train))
    tok.train_from_iterator((c for c in chunks if c), trainer=trainer)
    return tok


def _check_out_dir(src: str, out_dir: str) -> None:
    """Before the passes: OUT_DIR can be a directory here, and is not among the sources."""
    out, source = os.path.realpath(out_dir), os.path.realpath(src)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise PrepareError(f"{out_dir}: a file, not a directory; give a directory for the "
                           "dataset (created if missing)")
    if os.path.isdir(src) and (out == source or out.startswith(source + os.sep)):
        raise PrepareError(f"{out_dir} is inside SRC {src}: its token files would be read as "
                           "text by the next prepare of SRC; give a directory outside it")
    parent = out
    while not os.path.exists(parent):  # the nearest directory that exists must be writable
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise PrepareError(f"{out_dir}: cannot be created or written ({parent} is not "
                           "writable); give a directory you can write")


def _load_bpe(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError(f"{path} is a BPE tokenizer, which needs Hugging Face `tokenizers`: "
                           "pip install 'ringtrain[tokens]' (or pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclass, or OSError
        raise PrepareError(f"{path}: cannot read the BPE tokenizer ({e})") from None


def prepare(src: str, out_dir: str, *, tokenizer: str = "char", vocab_size: int | None = None,
            val_fraction: float = VAL_FRACTION, progress: bool = True,
            chunk_chars: int = CHUNK_CHARS, reuse: dict | None = None) -> dict:
    """Tokenize `src` into `out_dir` (train.bin, val.bin, meta.json); returns the meta dict.

    Args:
        src: a UTF-8 text file, or a folder of them.
        out_dir: created if missing; existing token files there are replaced.
        tokenizer: "char" (every distinct character) or "bpe" (byte-level BPE).
        vocab_size: BPE only: tokens in the vocabulary, 256 or more.
        val_fraction: the end of the text held out for validation, in (0, 1).
        progress: tqdm bars on stderr.
        chunk_chars: characters read at a time (memory use).
        reuse: a model's or dataset's tokenizer to encode with instead of one made here
            (`--tokenizer-from`: {"type": "char", "chars"} or {"type": "bpe", "file"}, and
            "source", the directory named in messages); `tokenizer` and `vocab_size` are its.
    """
    if reuse is not None:
        if reuse["type"] not in ("char", "bpe"):
            raise PrepareError(f"--tokenizer-from {reuse.get('source')}: the model reads the "
                               "addition task's digits, which tokenize no text; give a model "
                               "trained on text, or a prepared dataset")
        tokenizer, vocab_size = reuse["type"], None
    if tokenizer not in ("char", "bpe"):
        raise PrepareError(f"--tokenizer {tokenizer}: use 'char' or 'bpe'")
    if tokenizer == "char" and vocab_size is not None:
        raise PrepareError("--vocab-size applies to --tokenizer bpe (a character vocabulary is "
                           "the text's own characters); drop it or add --tokenizer bpe")
    if tokenizer == "bpe" and reuse is None:
        vocab_size = 4096 if vocab_size is None else vocab_size
        if vocab_size < MIN_BPE_VOCAB:
            raise PrepareError(f"--vocab-size {vocab_size}: a byte-level BPE starts from the "
                               f"{MIN_BPE_VOCAB} byte values; use --vocab-size "
                               f"{MIN_BPE_VOCAB} or more")

    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction}: it must be between 0 and 1, e.g. 0.1")
    files = source_files(src)
    _check_out_dir(src, out_dir)
    n_chars, chars = _scan(files, chunk_chars, progress)
    if n_chars == 0:
        raise PrepareError(f"{src}: the text is empty; give a file with text in it")
    n_train = int(n_chars * (1 - val_fraction))
    if n_train == 0 or n_train == n_chars:
        raise PrepareError(f"{src}: {n_chars} characters with --val-fraction {val_fraction} leave "
                           f"{n_train} for training and {n_chars - n_train} for validation; both "
                           "need some: use a longer text or another --val-fraction")
    meta: dict = {"format": FORMAT, "version": 1, "tokenizer": tokenizer,
                  "sources": [os.path.abspath(f) for f in files], "characters": n_chars,
                  "train_characters": n_train, "val_fraction": val_fraction}
    if reuse is not None:
        meta["tokenizer_from"] = reuse.get("source")
    if tokenizer == "char":
        vocab = sorted(chars) if reuse is None else list(reuse["chars"])  # ids in its order
        unknown = sorted(chars - set(vocab))
        if unknown:
            raise PrepareError(
                f"{src}: {len(unknown)} of its characters {'is' if len(unknown) == 1 else 'are'} "
                "not in the vocabulary of "
                f"--tokenizer-from {reuse and reuse.get('source')} ({len(vocab)} characters): "
                f"{''.join(unknown[:20])!r}; remove them from the text, or drop --tokenizer-from "
                "for a vocabulary of the text's own (a run on it cannot start --init-from that "
                "model)")
        codepoints = np.array([ord(c) for c in vocab], dtype=np.uint32)
        order = np.argsort(codepoints, kind="stable")  # the identity for a vocabulary made here
        meta.update(vocab_size=len(vocab), chars=vocab)

        def encode(text: str) -> np.ndarray:
            # An id is the code point's rank among the sorted code points, mapped back to the
            # vocabulary's own order (prepare's is sorted; a reused one keeps its ids).
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            return order[np.searchsorted(codepoints[order], cps)]
    else:
        bpe = (_load_bpe(reuse["file"]) if reuse is not None else
               _train_bpe(files, n_train, vocab_size or 0, chunk_chars))
        got = bpe.get_vocab_size()
        if reuse is None and got < (vocab_size or 0):
            raise PrepareError(
                f"--vocab-size {vocab_size} is larger than the training split supports: BPE "
                f"found only {got} tokens (every merge of its {n_train} characters); use "
                f"--vocab-size {got} or less, or more text")
        meta.update(vocab_size=got, tokenizer_file=TOKENIZER_FILE)

        def encode(text: str) -> np.ndarray:
            return np.asarray(bpe.encode(text).ids)
    dtype = token_dtype(meta["vocab_size"])
    meta["dtype"] = dtype
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": 0, "val": 0}
    tmp = {s: os.path.join(out_dir, f"{s}.bin.tmp") for s in counts}
    bar = _Bar(n_chars, "encode", progress)
    try:
        with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
            chunks = read_chunks(files, chunk_chars, whole_lines=tokenizer == "bpe")
            for train, val in _split(chunks, n_train):
                for name, text, f in (("train", train, ftrain), ("val", val, fval)):
                    if text:
                        ids = encode(text).astype(dtype)
                        f.write(ids.tobytes())
                        counts[name] += len(ids)
                bar.update(len(train) + len(val))
        # An earlier dataset here stays whole until now (a Ctrl-C or a full disk while encoding
        # leaves it as it was); from here, no meta.json: unfinished until the end.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, META))
        for s in counts:
            os.replace(tmp[s], os.path.join(out_dir, f"{s}.bin"))
    finally:
        bar.close()
        for path in tmp.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    if tokenizer == "bpe":
        bpe.save(os.path.join(out_dir, TOKENIZER_FILE))
    meta.update(train_tokens=counts["train"], val_tokens=counts["val"])
    path = os.path.join(out_dir, META)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return meta
