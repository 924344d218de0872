"""Training on a prepared token directory (`ringtrain train --data DIR`), memory-mapped.

    python -c "from ringtrain.data.tokens import load_tokens; \
print(load_tokens('data/shakespeare', 64))"


`ringtrain prepare` (`ringtrain.data.prepare`) writes the directory. Here train.bin and val.bin
are opened with `np.memmap` (nothing is read until a window is asked for), and cut into windows
exactly as `ringtrain.data.chars` always did for a text: every window of block_size + 1 tokens
at stride 1 for training, non-overlapping ones for validation, at most MAX_EVAL_WINDOWS of them
evenly spaced. The validation windows are a fixed set (they depend on the files and block_size
only), so a run on 1 and on N processes scores the same windows: the trainer's exact-mode
evaluation then reports the same loss.

`--data FILE.txt` goes through the same path: `prepare_text_in` prepares the file at char level
into RUN_DIR/data once (a rank that finds it prepared for the same file reuses it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data.prepare import META, VAL_FRACTION, PrepareError, prepare

MAX_EVAL_WINDOWS = 2048  # as ringtrain.data.chars: a large file must not make every evaluation slow


class TokenWindows(Dataset):
    """Windows over a token file: x = tokens[s:s+T], y = tokens[s+1:s+T+1], as int64 tensors.

    Args:
        path: a raw token file (`dtype`), opened read-only with np.memmap on first use.
        dtype: "uint16" or "uint32".
        block_size: T.
        stride: distance between window starts (1 for training, T for validation).
        max_windows: keep at most this many, evenly spaced (None keeps all).
    """

    def __init__(self, path: str, dtype: str, block_size: int, stride: int = 1,
                 max_windows: int | None = None):
        self.path, self.dtype, self.block_size, self.stride = (
            path, np.dtype(dtype), block_size, stride)

        self.n_tokens = os.path.getsize(path) // self.dtype.itemsize
        if self.n_tokens < block_size + 1:
            raise ValueError(f"{path}: {self.n_tokens} tokens cannot hold one window of "
                             f"block_size + 1 = {block_size + 1}")
        self.n_windows = len(range(0, self.n_tokens - block_size, stride))
        self.picks: torch.Tensor | None = None  # window numbers kept when capped
        if max_windows is not None and self.n_windows > max_windows:
            # The same choice as chars.CharDataset (which indexed a tensor of all the starts).
            self.picks = torch.linspace(0, self.n_windows - 1, max_windows).long()
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:  # opened lazily: a dataset handed to another process maps anew
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.n_windows if self.picks is None else len(self.picks)

    def start(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        return (i if self.picks is None else int(self.picks[i])) * self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.start(i)
        chunk = torch.from_numpy(self.tokens[s : s + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class CharTokenizer:
    """Every distinct character of the text is a token, in code point order."""

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the vocabulary; use characters "
                             "of the training text")
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class BPETokenizer:
    """A byte-level BPE saved by `tokenizers` (tokenizer.json): any text encodes."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"{path} is a BPE tokenizer, which needs Hugging Face `tokenizers`: "
                             "pip install 'ringtrain[tokens]'") from None
        self.tokenizer = Tokenizer.from_file(path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _holds_text(path: str) -> bool:
    """Whether `path` holds files `ringtrain prepare` would read (not hidden, at any depth)
    and none of a dataset's own (an unfinished preparation is not a folder of text)."""
    own = {"train.bin", "val.bin", META, "tokenizer.json"}
    found = False
    for _, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if own & set(names):
            return False
        found = found or any(not n.startswith(".") for n in names)
    return found


def read_meta(path: str) -> dict[str, Any]:
    """A prepared directory's meta.json, or a ValueError saying what is missing."""
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        if _holds_text(path):  # the text itself, unprepared
            out = os.path.normpath(path) + "_tokens"
            raise ValueError(f"--data {path}: a folder of text, not a prepared token dataset "
                             f"({META} is missing); prepare it once: `ringtrain prepare {path} "
                             f"{out}`, then --data {out} (or give a single .txt file, prepared "
                             "into the run directory)")
        raise ValueError(f"--data {path}: a directory without {META}: not a prepared token "
                         f"dataset (or its preparation did not finish); run `ringtrain prepare "
                         f"SRC {path}` first, or give a .txt file")
    with open(meta_path, encoding="utf-8") as f:
        return json.load(f)


def tokenizer_from(meta: dict[str, Any], directory: str) -> CharTokenizer | BPETokenizer:
    if meta["tokenizer"] == "char":
        return CharTokenizer(meta["chars"])
    return BPETokenizer(os.path.join(directory, meta["tokenizer_file"]))


@dataclass
class TokenData:
    """A prepared directory split for training: windows, tokenizer and meta."""

    path: str
    train_set: TokenWindows
    eval_set: TokenWindows
    tokenizer: CharTokenizer | BPETokenizer
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def __repr__(self) -> str:
        return (f"TokenData({self.path!r}: {self.meta['tokenizer']} vocab {self.vocab_size}, "
                f"{len(self.train_set)} train windows, {len(self.eval_set)} validation windows)")


def check_tokens(path: str, block_size: int) -> dict[str, Any]:
    """The meta of a prepared directory that holds a window of `block_size` + 1 in each split."""
    meta = read_meta(path)
    for split in ("train", "val"):
        need = block_size + 1
        have = meta[f"{split}_tokens"]
        if have < need:
            raise ValueError(f"--data {path}: {split}.bin has {have} tokens, fewer than one window "
                             f"of --block-size + 1 = {need}; use a smaller --block-size or prepare "
                             f"more text (or a larger --val-fraction)")
        size = os.path.getsize(os.path.join(path, f"{split}.bin"))
        if size != have * np.dtype(meta["dtype"]).itemsize:
            raise ValueError(f"--data {path}: {split}.bin holds {size} bytes but {META} says "
                             f"{have} {meta['dtype']} tokens; prepare it again")
    return meta


def load_tokens(path: str, block_size: int) -> TokenData:
    """Memory-map a prepared directory's splits as training and validation windows."""
    meta = check_tokens(path, block_size)
    train = TokenWindows(os.path.join(path, "train.bin"), meta["dtype"], block_size, stride=1)
    val = TokenWindows(os.path.join(path, "val.bin"), meta["dtype"], block_size,
                       stride=block_size, max_windows=MAX_EVAL_WINDOWS)
    return TokenData(path, train, val, tokenizer_from(meta, path), meta)


def train_windows(meta: dict[str, Any], block_size: int) -> int:
    return meta["train_tokens"] - block_size


def prepare_text_in(text_path: str, run_dir: str, *, keep_chars: bool = False) -> str:
    """RUN_DIR/data: `text_path` prepared at char level (90/10), made once and then reused;
    prepared again when the text changed. With `keep_chars` (a run there to resume, whose
    snapshots read the earlier preparation's ids) a text of other characters is a ValueError,
    the earlier preparation left in place.

    Several ranks may call it at once: they take turns (an flock on RUN_DIR), the first
    prepares into a directory of its own and renames it into place, the others find it made.
    (Each making its own copy and the first rename winning let a later rank take the first
    one's copy for an older preparation and delete it under the first rank's reader.)
    """
    out = os.path.join(run_dir, "data")
    source = os.path.abspath(text_path)
    stat = os.stat(text_path)
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def prepared() -> bool:
        try:
            meta = read_meta(out)
        except (ValueError, OSError):
            return False
        return meta.get("sources") == [source] and meta.get("source_stat") == stamp

    if prepared():
        return out
    os.makedirs(run_dir, exist_ok=True)
    turn = os.open(run_dir, os.O_RDONLY)
    tmp = os.path.join(run_dir, f".data-{uuid.uuid4().hex[:8]}")
    try:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks (some NFS mounts): the ranks' copies are
            pass  # identical, and the checks below keep most from replacing another's
        if prepared():  # made by a rank before this one
            return out
        meta = prepare(text_path, tmp, tokenizer="char", val_fraction=VAL_FRACTION, progress=False)
        meta["source_stat"] = stamp
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
        if prepared():  # unlocked only: another rank's copy landed meanwhile
            return out
        _check_chars(out, meta, text_path, keep_chars)
        if os.path.isdir(out):  # an older preparation (another file): replaced
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not prepared():  # unlocked only: another rank's identical copy won the rename
                raise
    except PrepareError as e:
        raise ValueError(f"--data {text_path}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(turn)  # and with it the lock
    return out


def _check_chars(out: str, meta: dict, text_path: str, keep_chars: bool) -> None:
    """Where the run's snapshots must keep reading `out`'s ids: the text's characters are
    those of the preparation there, or a ValueError (nothing replaced)."""
    try:
        earlier = read_meta(out).get("chars")
    except (ValueError, OSError):
        return  # none there, or unreadable: nothing a snapshot could read
    if not keep_chars or earlier is None or earlier == meta["chars"]:
        return
    new, gone = sorted(set(meta["chars"]) - set(earlier)), sorted(set(earlier) - set(meta["chars"]))
    which = "; ".join(f"{what}: {''.join(c)!r}" for what, c in (("new", new), ("gone", gone)) if c)
    raise ValueError(
        f"--data {text_path} changed since this run prepared it into {out}, and its characters "
        f"with it ({len(earlier)} then, {len(meta['chars'])} now; {which}): the run's snapshots "
        "read the token ids of the earlier ones. Resume with the text as it was, or start "
        "afresh with --no-resume (the earlier run is set aside) or in another --run-dir")


@torch.no_grad()
def sample_tokens(model: torch.nn.Module, data: TokenData, length: int = 300, *, seed: int = 0,
                  temperature: float = 0.8, top_k: int | None = 10) -> str:
    """`length` tokens generated by `model`, from the validation split's first token."""
    start = data.eval_set[0][0][:1].view(1, 1)
    g = torch.Generator().manual_seed(seed)
    out = model.generate(start, length, temperature=temperature, top_k=top_k, generator=g,
                         vocab=data.vocab_size)
    return data.decode(out[0].tolist())
