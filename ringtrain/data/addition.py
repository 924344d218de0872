"""The embedded default task: n-digit addition with a held-out test set (minGPT's adder).

    python -c "from ringtrain.data.addition import AdditionDataset as D; d = D('train'); \
print(len(d), d[0])"

A sum a + b = c is one token sequence of digits: a (n digits, zero-padded), b (n digits), then
c reversed (n + 1 digits), e.g. 85 + 50 = 135 with n=2 is `8 5 5 0 5 3 1`. c is reversed because
a model writing left to right produces the least significant digit first, as a person adds.
Inputs are the sequence minus its last token, targets the sequence shifted by one with -1 on
every position before the answer, so only the answer digits are trained and scored.

Every (a, b) pair exists exactly once; a fixed permutation (independent of the training seed)
puts min(20 %, 500) of them in the test split and the rest in train, so the two are disjoint
and the test set is the same for every run.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

DEFAULT_DIGITS = 2  # `make demo`'s task (`ringtrain train` reads it from here)
MAX_DIGITS = 3  # 10**(2n) pairs are materialised; n=3 is already a million
VOCAB = 10  # the tokens are the digits 0-9 ('+' and '=' are implied by position)
SPLIT_SEED = 1337  # fixed: the held-out set must not move when --seed changes


def train_size(digits: int) -> int:
    """Sums in the train split, counted without building it (3 digits: 10^6 sums, ~10 s)."""
    num = 10 ** (2 * digits)
    return num - min(num // 5, 500)


def sequence_length(digits: int) -> int:
    """Tokens per sample (the model's block size): the sequence less its last token."""
    return 3 * digits


def encode(a: int, b: int, digits: int) -> list[int]:
    """The full token sequence for a + b (length 3 * digits + 1)."""
    c = a + b
    operands = f"{a:0{digits}d}{b:0{digits}d}"
    return [int(ch) for ch in operands] + [int(ch) for ch in f"{c:0{digits + 1}d}"[::-1]]


def decode_answer(answer_digits: list[int]) -> int:
    """c from its reversed digits, as the model writes them."""
    return int("".join(str(d) for d in reversed(answer_digits)))


class AdditionDataset(Dataset):
    """One split of all `digits`-digit sums, as (x, y) LongTensor pairs of length 3 * digits.

    Args:
        split: "train" or "test".
        digits: operand length n, 1..3.
    """

    def __init__(self, split: str, digits: int = DEFAULT_DIGITS):
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: use 'train' or 'test'")
        if not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
            raise ValueError(f"digits={digits!r}: the addition task supports "
                             f"1..{MAX_DIGITS} digits")

        self.split, self.digits = split, digits
        num = 10 ** (2 * digits)
        perm = torch.randperm(num, generator=torch.Generator().manual_seed(SPLIT_SEED))
        num_test = num - train_size(digits)
        ids = perm[:num_test] if split == "test" else perm[num_test:]
        self.pairs = [(int(i) // 10**digits, int(i) % 10**digits) for i in ids]
        seqs = torch.tensor([encode(a, b, digits) for a, b in self.pairs], dtype=torch.long)
        self.x = seqs[:, :-1].contiguous()  # (N, 3n)
        self.y = seqs[:, 1:].clone()  # (N, 3n)
        self.y[:, : 2 * digits - 1] = -1  # only the n + 1 answer digits count

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def block_size(self) -> int:
        return sequence_length(self.digits)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def exact_match(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample 1.0 when every answer digit's argmax is right, else 0.0.

    With teacher forcing this equals greedy generation's exact match: if every digit is right
    given the right prefix, greedy decoding produces that prefix, and vice versa.
    """
    mask = targets != -1
    right = (logits.argmax(dim=-1) == targets) | ~mask  # (B, T)
    return right.all(dim=1).float()


@torch.no_grad()
def answer(model: torch.nn.Module, a: int, b: int, digits: int) -> str:
    """a + b as the model answers it by greedy decoding, e.g. '47+85=132 ok' or
    '47+85=131 (wrong: 132)'."""
    prompt = torch.tensor([encode(a, b, digits)[: 2 * digits]], dtype=torch.long)
    out = model.generate(prompt, digits + 1, temperature=0, vocab=VOCAB)
    got = decode_answer(out[0, 2 * digits:].tolist())
    return f"{a}+{b}={got} {'ok' if got == a + b else f'(wrong: {a + b})'}"


def show_sums(model: torch.nn.Module, dataset: AdditionDataset, count: int = 3) -> str:
    """A few held-out sums as the model answers them, joined by '; '."""
    return "; ".join(answer(model, a, b, dataset.digits) for a, b in dataset.pairs[:count])
