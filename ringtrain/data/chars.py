"""Character-level language modelling on the user's own text (`ringtrain train --data FILE.txt`).

    python -c "from ringtrain.data.chars import load_text; t = load_text('README.md', 32); print(t)"

The vocabulary is every distinct character of the file. The first 90 % of the text is for
training (every window of block_size + 1 characters, stride 1), the last 10 % for validation
(non-overlapping windows, so each validation character is scored once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

VAL_FRACTION = 0.1
MAX_EVAL_WINDOWS = 2048  # cap so a large file does not make every evaluation slow


class CharDataset(Dataset):
    """Windows over a 1-D tensor of token ids: x = data[i:i+T], y = data[i+1:i+T+1].

    Args:
        data: token ids, shape (N,).
        block_size: T.
        stride: distance between window starts (1 for training, T for validation).
        max_windows: keep at most this many, evenly spaced (None keeps all).
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1,
                 max_windows: int | None = None):
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} tokens cannot hold one window of block_size + 1 = "
                             f"{block_size + 1}")
        self.data, self.block_size = data, block_size
        starts = torch.arange(0, data.numel() - block_size, stride)
        if max_windows is not None and len(starts) > max_windows:
            starts = starts[torch.linspace(0, len(starts) - 1, max_windows).long()]
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@dataclass
class TextData:
    """A text file split for training: datasets plus the character vocabulary."""

    path: str
    train_set: CharDataset
    eval_set: CharDataset
    chars: list[str]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        stoi = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted({c for c in text if c not in stoi})
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the vocabulary of {self.path}")
        return [stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def __repr__(self) -> str:
        return (f"TextData({self.path!r}: vocab {self.vocab_size}, {len(self.train_set)} train "
                f"windows, {len(self.eval_set)} validation windows)")


def min_chars(block_size: int) -> int:
    """Shortest text whose validation split holds one window of block_size + 1 characters."""
    return int((block_size + 1) / VAL_FRACTION) + 1


def train_windows(n_chars: int, block_size: int) -> int:
    """Training windows in a text of `n_chars` characters (what `load_text` makes of it)."""
    return _train_chars(n_chars) - block_size


def _train_chars(n_chars: int) -> int:
    return int(n_chars * (1 - VAL_FRACTION))


def text_warnings(path: str, text: str) -> list[str]:
    """What is allowed but almost surely not meant, one line each: a single repeated character."""
    chars = sorted(set(text))
    if len(chars) == 1:
        return [f"--data {path}: the text has a vocabulary of one character ({chars[0]!r}): every "
                "next character is certain, so the loss is 0 from the first step and the model "
                "learns nothing; use a text with more than one distinct character"]
    return []


def read_text(path: str, block_size: int) -> str:
    """The file's text, or a ValueError that says what is wrong and what to do."""
    if not os.path.exists(path):
        raise ValueError(f"--data {path}: no such file; give the path of a UTF-8 text file")
    if os.path.isdir(path):
        raise ValueError(f"--data {path}: is a directory; give the path of a UTF-8 text file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path}: not UTF-8 text (byte {e.start}: {e.reason}); "
                         "convert it to UTF-8 first") from None
    need = min_chars(block_size)
    if len(text) < need:
        raise ValueError(
            f"--data {path}: {len(text)} characters is too short for --block-size {block_size}: "
            f"the {VAL_FRACTION:.0%} validation split needs one window of {block_size + 1} "
            f"characters, so the file needs at least {need}; use a longer text or a smaller "
            "--block-size"

        )
    return text


def load_text(path: str, block_size: int) -> TextData:
    """Read `path` and build the 90/10 train/validation split as character windows."""
    text = read_text(path, block_size)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_train = _train_chars(len(data))
    train = CharDataset(data[:n_train], block_size, stride=1)
    val = CharDataset(data[n_train:], block_size, stride=block_size, max_windows=MAX_EVAL_WINDOWS)
    return TextData(path, train, val, chars)

