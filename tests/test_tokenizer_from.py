"""A model's tokenizer travels with it: `ringtrain export` records it, `--init-from` refuses data
tokenized otherwise (the same vocabulary size reads every token as another one, silently), and
`ringtrain prepare --tokenizer-from DIR` tokenizes new text the model's way.

    .venv/bin/pytest -q tests/test_tokenizer_from.py

In-process, one rank, CPU; BPE cases need `tokenizers` (skipped with the reason without it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringtrain.cli import main as ringtrain_main
from ringtrain.cli.train import main as train_main
from ringtrain.data.prepare import PrepareError, prepare
from ringtrain.data.tokens import CharTokenizer, load_tokens, read_meta
from ringtrain.formats.tokenizer import (
    data_tokenizer,
    dataset_tokenizer,
    difference,
    read_tokenizer,
)

pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace
TINY = ["--steps", "2", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4",
        "--block-size", "8", "--eval-every", "2", "--no-progress", "--threads", "1",
        "--no-report"]
WORDS = "the quick brown fox jumps over a lazy dog".split()  # every letter: 26 + ' ', '.', '\n'


def _text(path, end: str = ".", lines: int = 200, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    path.write_text("".join(" ".join(rng.choice(WORDS, 6)) + end + "\n" for _ in range(lines)))
    return str(path)


def test_unit_difference_names_what_differs():
    chars = dataset_tokenizer("d", {"tokenizer": "char", "chars": list("\n .ab")})
    assert difference(chars, chars) is None
    other = {"type": "char", "chars": list("\n !ab")}
    assert difference(chars, other) == (
        "the model's char tokenizer has 5 characters, the data's 5, and token 2 is '.' in the "
        "model's but '!' in the data's (the data has characters the model never saw: '!')")
    assert difference(chars, data_tokenizer(None)) == (
        "the model was trained with a char tokenizer of 5 characters, the data is the addition "
        "task's digits")


def test_same_vocabulary_size_other_characters_is_refused_and_prepare_fixes_it(tmp_path, capsys):
    first = tmp_path / "first"
    prepare(_text(tmp_path / "a.txt"), str(first), progress=False)
    assert train_main([*TINY, "--data", str(first), "--run-dir", str(tmp_path / "run")]) == 0
    assert ringtrain_main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format",
                           "hf"]) == 0
    assert ringtrain_main(["export", str(tmp_path / "run"), str(tmp_path / "dcp"), "--format",
                           "dcp"]) == 0
    recorded = read_tokenizer(str(tmp_path / "run"))
    assert recorded == {"type": "char", "chars": read_meta(str(first))["chars"]}
    assert read_tokenizer(str(tmp_path / "hf")) == read_tokenizer(str(tmp_path / "dcp")) == recorded
    # New text with '!' for '.': 29 characters again, so the shapes match, but token 2 differs.
    second = tmp_path / "second"
    src = _text(tmp_path / "b.txt", end="!", seed=1)
    prepare(src, str(second), progress=False)
    assert read_meta(str(second))["vocab_size"] == read_meta(str(first))["vocab_size"] == 29
    for model in ("run", "hf", "dcp"):
        capsys.readouterr()
        assert train_main([*TINY, "--data", str(second), "--init-from", str(tmp_path / model),
                           "--run-dir", str(tmp_path / f"r-{model}")]) == 2
        err = capsys.readouterr().err
        assert (f"--init-from {tmp_path / model}: the model's char tokenizer has 29 characters, "
                "the data's 29, and token 2 is '.' in the model's but '!' in the data's") in err
        assert f"ringtrain prepare SRC OUT_DIR --tokenizer-from {tmp_path / model}" in err
    # --tokenizer-from: the '!' is not in the model's vocabulary: said, nothing written
    assert ringtrain_main(["prepare", src, str(tmp_path / "x"), "--tokenizer-from",
                           str(tmp_path / "hf"), "--no-progress"]) == 2
    assert "1 of its characters is not in the vocabulary of --tokenizer-from" in (
        capsys.readouterr().err)
    # text the model's characters cover: tokenized its way, and the run starts from the model
    third = tmp_path / "third"
    assert ringtrain_main(["prepare", _text(tmp_path / "c.txt", seed=2), str(third),
                           "--tokenizer-from", str(tmp_path / "hf"), "--no-progress"]) == 0
    meta = read_meta(str(third))
    assert meta["chars"] == recorded["chars"] and meta["tokenizer_from"] == str(tmp_path / "hf")
    assert train_main([*TINY, "--data", str(third), "--init-from", str(tmp_path / "hf"),
                       "--run-dir", str(tmp_path / "r-third")]) == 0


def test_a_reused_vocabulary_keeps_its_own_ids(tmp_path):
    """A vocabulary not in code point order (not prepare's own) still encodes by its ids."""
    chars = list("z.\n yxabcdefghijklmnopqrstuvw")[::-1]  # any order
    src = tmp_path / "t.txt"
    src.write_text("a lazy fox.\nby the way.\n" * 40)
    out = tmp_path / "d"
    prepare(str(src), str(out), progress=False,
            reuse={"type": "char", "chars": chars, "source": "mine"})
    data = load_tokens(str(out), 8)
    ids = np.fromfile(out / "train.bin", dtype=read_meta(str(out))["dtype"])
    text = src.read_text()
    assert ids.tolist() == CharTokenizer(chars).encode(text[:len(ids)])
    assert data.decode(ids[:11].tolist()) == "a lazy fox."


def test_prepare_tokenizer_from_mistakes_are_one_line(tmp_path, capsys):
    src = _text(tmp_path / "a.txt")
    prepare(src, str(tmp_path / "d"), progress=False)
    for argv, said in [
        (["--tokenizer-from", str(tmp_path / "nope")], "no such directory"),
        (["--tokenizer-from", str(tmp_path)], "records no tokenizer; give a prepared dataset"),
        (["--tokenizer-from", str(tmp_path / "d"), "--tokenizer", "bpe"],
         "drop --tokenizer and --vocab-size"),
    ]:
        assert ringtrain_main(["prepare", src, str(tmp_path / "o"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    with pytest.raises(PrepareError, match="the addition task's digits, which tokenize no text"):
        prepare(src, str(tmp_path / "o"), reuse={"type": "digits", "source": "run"})


def test_bpe_of_the_same_size_trained_elsewhere_is_refused(tmp_path, capsys):
    pytest.importorskip("tokenizers", reason="BPE needs `tokenizers` (pip install "
                        "'ringtrain[tokens]')")
    big = _text(tmp_path / "a.txt", lines=600)
    prepare(big, str(tmp_path / "bpe1"), tokenizer="bpe", vocab_size=260, progress=False)
    small = _text(tmp_path / "b.txt", lines=600, seed=1)
    prepare(small, str(tmp_path / "bpe2"), tokenizer="bpe", vocab_size=260, progress=False)
    assert train_main([*TINY, "--data", str(tmp_path / "bpe1"), "--run-dir",
                       str(tmp_path / "run")]) == 0
    assert ringtrain_main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format",
                           "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["ringtrain"]["tokenizer"] == {"type": "bpe", "file": "tokenizer.json"}
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        tmp_path / "bpe1" / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert train_main([*TINY, "--data", str(tmp_path / "bpe2"), "--init-from",
                       str(tmp_path / "hf"), "--run-dir", str(tmp_path / "r2")]) == 2
    assert "have other vocabularies or merges" in capsys.readouterr().err
    assert ringtrain_main(["prepare", small, str(tmp_path / "bpe3"), "--tokenizer-from",
                           str(tmp_path / "hf"), "--no-progress"]) == 0
    assert train_main([*TINY, "--data", str(tmp_path / "bpe3"), "--init-from",
                       str(tmp_path / "hf"), "--run-dir", str(tmp_path / "r3")]) == 0


def test_an_export_samples_and_converts_like_its_run(tmp_path, capsys):
    """`ringtrain sample` and `ringtrain export` take an export too (they crashed on an hf
    directory's config.json): the same text as the run's model, and hf <-> dcp conversions."""
    data = tmp_path / "d"
    prepare(_text(tmp_path / "a.txt"), str(data), progress=False)
    run = tmp_path / "run"
    assert train_main([*TINY, "--data", str(data), "--run-dir", str(run)]) == 0
    assert ringtrain_main(["export", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert ringtrain_main(["export", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--format",
                           "dcp"]) == 0
    assert read_tokenizer(str(tmp_path / "dcp")) == read_tokenizer(str(run))
    capsys.readouterr()
    said = []
    for path in (run, tmp_path / "hf", tmp_path / "dcp"):
        assert ringtrain_main(["sample", str(path), "--prompt", "the ", "--tokens", "30"]) == 0
        said.append(capsys.readouterr().out)
    assert said[0].startswith("the ") and said == [said[0]] * 3
    assert ringtrain_main(["sample", str(tmp_path / "hf"), "--snapshot", "2"]) == 2
    assert "is an export (one model); give the run directory" in capsys.readouterr().err
    # the addition task: its digits are recorded, and the sums answered from the export alone
    add = tmp_path / "add"
    no_block = [a for i, a in enumerate(TINY) if "--block-size" not in TINY[max(i - 1, 0):i + 1]]
    assert train_main([*no_block, "--run-dir", str(add)]) == 0
    assert ringtrain_main(["export", str(add), str(tmp_path / "add_hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    assert ringtrain_main(["sample", str(add), "--prompt", "12+34"]) == 0
    from_run = capsys.readouterr().out
    assert ringtrain_main(["sample", str(tmp_path / "add_hf"), "--prompt", "12+34"]) == 0
    assert capsys.readouterr().out == from_run and from_run.startswith("12+34=")


@pytest.mark.parametrize("data", ["text", "dir"])
def test_a_resume_on_a_text_edited_since_is_refused_by_its_tokenizer(tmp_path, capsys, data):
    """'!' for '.': 29 characters still, so the model's shapes fit and the resume went on,
    every '.' read as '!' and ids shifted; now the snapshot's tokenizer is compared (a
    prepared --data DIR), and a --data FILE.txt is refused before RUN_DIR/data is replaced."""
    from ringtrain.checkpoint.rules import tokenizer_change

    text, prepared = tmp_path / "t.txt", str(tmp_path / "prepared")
    _text(text)
    if data == "dir":
        prepare(str(text), prepared, tokenizer="char", progress=False)
    run = ["--data", str(text) if data == "text" else prepared, "--run-dir",
           str(tmp_path / "run"), "--snapshot-every", "2"]
    assert train_main([*TINY, *run]) == 0
    assert train_main([*TINY[:1], "3", *TINY[2:], *run]) == 0  # the same text: resumes
    text.write_text(text.read_text().replace(".", "!"))
    if data == "dir":
        prepare(str(text), prepared, tokenizer="char", progress=False)
    capsys.readouterr()
    assert train_main([*TINY[:1], "4", *TINY[2:], *run]) == 2
    err = capsys.readouterr().err
    if data == "text":
        assert "changed since this run prepared it into" in err, err
        assert "(29 then, 29 now; new: '!'; gone: '.')" in err
        assert read_meta(str(tmp_path / "run" / "data"))["chars"].count(".") == 1  # kept
    else:
        assert "): the data's tokenizer is not the one the snapshot's model was trained with " \
               "(char, 29 tokens, " in err and "Resume with the data it was trained on" in err
    saved, now = {"lr": 1.0}, {"lr": 1.0, "tokenizer": "char, 29 tokens, x"}
    assert tokenizer_change(saved, now) is None and "tokenizer" not in now  # an older snapshot
