"""`ringtrain prepare` (`ringtrain.data.prepare`, `ringtrain.cli.prepare`): token files, the
tokenizers, bad input, and bounded memory on a corpus larger than the memory allowed."""

import json
import os
import random
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ringtrain.cli import main as ringtrain_main
from ringtrain.data import prepare as prepare_module
from ringtrain.data.chars import load_text
from ringtrain.data.prepare import prepare, read_chunks, source_files
from ringtrain.data.tokens import load_tokens


def _words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["the", "king", "queen", "shall", "speak", "of", "love", "and", "war", "my", "lord",
             "Good", "morrow,", "thee!", "what?", "naïve", "café"]
    lines = (" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 12))) for _ in range(n))
    return "\n".join(lines) + "\n"


def test_char_prepare_matches_the_in_memory_text_split(tmp_path):
    text = _words(300)
    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    meta = prepare(str(src), str(tmp_path / "d"), progress=False, chunk_chars=97)  # many chunks
    ref = load_text(str(src), 16)
    assert meta["chars"] == ref.chars and meta["dtype"] == "uint16"
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)
    ids = np.fromfile(tmp_path / "d" / "train.bin", dtype=np.uint16)
    assert ref.decode(ids.tolist()) == text[: int(len(text) * 0.9)]
    got = load_tokens(str(tmp_path / "d"), 16)
    assert len(got.train_set) == len(ref.train_set) and len(got.eval_set) == len(ref.eval_set)
    for i in (0, 7, len(ref.train_set) - 1):
        assert [t.tolist() for t in got.train_set[i]] == [t.tolist() for t in ref.train_set[i]]
    assert [t.tolist() for t in got.eval_set[3]] == [t.tolist() for t in ref.eval_set[3]]


def test_folder_files_sorted_joined_by_a_newline(tmp_path):
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("bbb")  # no final newline: one is added before the next file
    (src / "a.txt").write_text("aaa\n")
    (src / "sub" / "c.txt").write_text("ccc\n")
    (src / ".hidden").write_text("never")
    assert ([os.path.relpath(f, src) for f in source_files(str(src))]
            == ["a.txt", "b.txt", "sub/c.txt"])
    assert "".join(read_chunks(source_files(str(src)), 2)) == "aaa\nbbb\nccc\n"


def test_bpe_trains_on_the_train_split_and_round_trips(tmp_path):
    pytest.importorskip("tokenizers", reason="pip install -e '.[dev]' (or '.[tokens]')")
    text = _words(2000)
    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    meta = prepare(str(src), str(tmp_path / "d"), tokenizer="bpe", vocab_size=300,
                   progress=False, chunk_chars=4096)
    assert meta["vocab_size"] == 300 and meta["tokenizer_file"] == "tokenizer.json"
    data = load_tokens(str(tmp_path / "d"), 8)
    n_train = int(len(text) * 0.9)
    train = np.fromfile(tmp_path / "d" / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "d" / "val.bin", dtype=np.uint16).tolist()
    # Chunks are cut at line ends, where the byte-level pre-tokenizer splits anyway: lossless.
    assert data.decode(train) == text[:n_train] and data.decode(val) == text[n_train:]
    assert len(train) < n_train / 2  # merges happened
    assert data.decode(data.encode("the king")) == "the king"


@pytest.mark.parametrize("make,argv,message", [
    (lambda p: None, ["missing"], "missing: no such file or directory"),
    (lambda p: (p / "empty_dir").mkdir(), ["empty_dir"], "the folder holds no files"),
    (lambda p: (p / "e.txt").write_text(""), ["e.txt"], "the text is empty"),
    (lambda p: (p / "b.txt").write_bytes(b"ok\xff\xfe" * 10), ["b.txt"], "not UTF-8 text"),
    (lambda p: (p / "t.txt").write_text("abc def\n" * 50), ["t.txt", "--tokenizer", "bpe",
     "--vocab-size", "5000"], r"--vocab-size 5000 is larger than the training split supports: "
     r"BPE found only \d+ tokens.*use --vocab-size \d+ or less"),
    (lambda p: (p / "t.txt").write_text("abc\n"), ["t.txt", "--tokenizer", "bpe", "--vocab-size",
     "100"], "starts from the 256 byte values"),
    (lambda p: (p / "t.txt").write_text("abc\n"), ["t.txt", "--vocab-size", "100"],
     "--vocab-size applies to --tokenizer bpe"),
    (lambda p: (p / "t.txt").write_text("a"), ["t.txt"], "both need some"),
])
def test_bad_input_is_one_message_and_exit_2(tmp_path, capsys, make, argv, message):
    if "5000" in argv:
        pytest.importorskip("tokenizers", reason="pip install -e '.[dev]' (or '.[tokens]')")
    make(tmp_path)
    argv = [str(tmp_path / argv[0]), *argv[1:]]
    assert ringtrain_main(["prepare", *argv, str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringtrain prepare: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_an_out_dir_that_cannot_hold_the_dataset_is_refused_before_the_passes(tmp_path,
                                                                              capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 20)
    (tmp_path / "f.txt").write_text("x")
    run, export = tmp_path / "run", tmp_path / "gpt2_dir"  # a run's and an export's files
    (run / "snapshots").mkdir(parents=True)
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "gpt2"}')
    for out, said in [(tmp_path / "f.txt", "f.txt: a file, not a directory"),
                      (corpus, "is inside SRC"), (corpus / "tokens", "is inside SRC"),
                      (run, f"OUT_DIR {run} holds a run, not a dataset, and the dataset's files "
                            "would go among its files. Give the dataset a directory of its own"),
                      (export, f"OUT_DIR {export} holds an hf export, not a dataset")]:
        assert ringtrain_main(["prepare", str(corpus), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]  # nothing written among them
    assert [p.name for p in run.iterdir()] == ["snapshots"]
    assert [p.name for p in export.iterdir()] == ["config.json"]
    assert ringtrain_main(["export", str(tmp_path), str(tmp_path / "f.txt"), "--format",
                           "hf"]) == 2
    assert "OUT_DIR " + str(tmp_path / "f.txt") + " is a file, not a directory" in (
        capsys.readouterr().err)


def test_a_failed_pass_with_progress_on_says_only_the_error(tmp_path, capsys):
    """In a log (no terminal) a pass ends with one count line; a failed one printed
    'scan: 0 bytes in 0.0 s' before its error."""
    (tmp_path / "b.txt").write_bytes(b"ok\xff\xfe" * 10)
    assert ringtrain_main(["prepare", str(tmp_path / "b.txt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringtrain prepare: error: ") and err.count("\n") == 1, err


_LIMITED = textwrap.dedent("""
    import importlib.util, resource, sys
    # prepare.py by its path: it needs numpy only, and `import ringtrain` would map torch too.
    spec = importlib.util.spec_from_file_location("prepare", sys.argv[4])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    def vm():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    limit = vm() + int(sys.argv[3])  # what the process already maps, plus a little
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:  # the control: reading the whole text does not fit
        open(sys.argv[1], encoding="utf-8").read()
        sys.exit("the limit does not bite: the whole text was read")
    except MemoryError:
        pass
    meta = mod.prepare(sys.argv[1], sys.argv[2], progress=True, chunk_chars=1 << 18)
    print(meta["train_tokens"] + meta["val_tokens"])
""")


def test_streaming_fits_a_memory_limit_smaller_than_the_corpus(tmp_path):
    """RLIMIT_AS of 32 MiB above the interpreter's own mappings; the corpus is 40 MB."""
    block = _words(20000, seed=1)  # ~1 MB
    src = tmp_path / "big.txt"
    with open(src, "w", encoding="utf-8") as f:
        n = 0
        while n < 40_000_000:
            f.write(block)
            n += len(block.encode())
    chars = len(block) * (n // len(block.encode()))
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _LIMITED, str(src), str(tmp_path / "d"),
                           str(32 << 20), prepare_module.__file__],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == chars
    # Not a terminal: one line.
    assert re.search(r"^encode: [\d,]+ chars in [\d.]+ s$", proc.stderr, re.M)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert os.path.getsize(tmp_path / "d" / "train.bin") == 2 * meta["train_tokens"]


def test_preparing_other_text_into_a_prepared_directory_says_what_it_replaced(tmp_path, capsys):
    """Runs trained on the earlier dataset resume on it only (refused on other data): the
    replacement is said, not silent; the same text prepared again is not a replacement."""
    for name, n in (("a.txt", 200), ("b.txt", 300)):
        (tmp_path / name).write_text(_words(n), encoding="utf-8")
    out = str(tmp_path / "d")
    argv = ["prepare", str(tmp_path / "a.txt"), out, "--no-progress"]
    assert ringtrain_main(argv) == 0 and "replaced" not in capsys.readouterr().out
    assert ringtrain_main(argv) == 0 and "replaced" not in capsys.readouterr().out  # the same
    first = json.loads((tmp_path / "d" / "meta.json").read_text())["train_tokens"]
    assert ringtrain_main(["prepare", str(tmp_path / "b.txt"), out, "--no-progress"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == f"{out}: replaced the dataset prepared there before (of a.txt, {first:,} " \
                      "train tokens)", said


def test_ctrl_c_while_encoding_leaves_the_earlier_dataset_whole(tmp_path, capsys, monkeypatch):
    """A long BPE encode interrupted: the dataset prepared there before is still whole (its
    meta.json went first, making it 'unfinished' for the whole encode), no .tmp files stay,
    and the command says so in one line, exit 130, not a KeyboardInterrupt traceback."""
    (tmp_path / "a.txt").write_text(_words(300), encoding="utf-8")
    out = tmp_path / "d"
    assert ringtrain_main(["prepare", str(tmp_path / "a.txt"), str(out), "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    real, calls = prepare_module._Bar.update, []

    def update(bar, n):  # the encode pass, once its first chunk is written to train.bin.tmp
        real(bar, n)
        if bar.desc == "encode":
            calls.append(sorted(p.name for p in out.iterdir()))
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare_module._Bar, "update", update)
    assert ringtrain_main(["prepare", str(tmp_path / "a.txt"), str(out), "--no-progress",
                           "--val-fraction", "0.2"]) == 130
    assert calls == [sorted([*before, "train.bin.tmp", "val.bin.tmp"])]  # it was writing
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    first = json.loads(before["meta.json"])["train_tokens"]
    assert capsys.readouterr().err == (f"ringtrain prepare: interrupted; {out} holds the dataset "
                                       f"prepared there before (of a.txt, {first:,} train "
                                       "tokens)\n")
