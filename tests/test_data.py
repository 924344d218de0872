"""The default addition task and character-level text (`ringtrain.data`)."""

import pytest
import torch

from ringtrain.data.addition import AdditionDataset, decode_answer, encode, exact_match
from ringtrain.data.chars import load_text, min_chars


def test_encoding_reverses_the_answer():
    assert encode(85, 50, 2) == [8, 5, 5, 0, 5, 3, 1]
    assert encode(3, 4, 1) == [3, 4, 7, 0]
    assert decode_answer([5, 3, 1]) == 135


def test_splits_disjoint_cover_everything_and_fixed():
    train, test = AdditionDataset("train"), AdditionDataset("test")
    assert (len(train), len(test)) == (9500, 500)
    assert not set(train.pairs) & set(test.pairs)
    assert len(set(train.pairs) | set(test.pairs)) == 10_000
    torch.manual_seed(123)  # the training seed must not move the held-out set
    assert AdditionDataset("test").pairs == test.pairs


def test_inputs_targets_and_mask():
    ds = AdditionDataset("test", digits=2)
    x, y = ds[0]
    a, b = ds.pairs[0]
    full = encode(a, b, 2)
    assert x.tolist() == full[:-1]
    assert y.tolist() == [-1, -1, -1] + full[4:]
    assert (ds.vocab_size, ds.block_size) == (10, 6)


def test_exact_match_scores_answers_only():
    y = torch.tensor([[-1, -1, 1, 2], [-1, -1, 3, 4]])
    logits = torch.nn.functional.one_hot(y.clamp(min=0), 10).float()
    logits[:, :2] = torch.randn(2, 2, 10)  # prompt positions do not count
    assert exact_match(logits, y).tolist() == [1.0, 1.0]
    logits[1, 3] = torch.nn.functional.one_hot(torch.tensor(5), 10).float()
    assert exact_match(logits, y).tolist() == [1.0, 0.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="1..3 digits"):
        AdditionDataset("train", digits=4)
    with pytest.raises(ValueError, match="'train' or 'test'"):
        AdditionDataset("val")


def test_text_split_windows_and_vocab(tmp_path):
    path = tmp_path / "t.txt"
    text = "hello world, " * 40
    path.write_text(text)
    data = load_text(str(path), block_size=8)
    assert data.chars == sorted(set(text))
    assert data.decode(data.encode("hello")) == "hello"
    x, y = data.train_set[3]
    assert data.decode(x.tolist()) == text[3:11] and data.decode(y.tolist()) == text[4:12]
    n_train = int(len(text) * 0.9)
    assert len(data.train_set) == n_train - 8
    val = text[n_train:]
    assert data.decode(data.eval_set[1][0].tolist()) == val[8:16]  # non-overlapping windows


def test_text_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_text(str(tmp_path / "missing.txt"), 8)
    with pytest.raises(ValueError, match="is a directory"):
        load_text(str(tmp_path), 8)
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    with pytest.raises(ValueError, match=f"at least {min_chars(64)}.*--block-size"):
        load_text(str(short), 64)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe" * 500)
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(str(binary), 8)
