"""`ringtrain train --data DIR`: memory-mapped token windows (`ringtrain.data.tokens`), sampled
through the resumable DistributedSampler, and the same validation loss on 1 and 2 processes."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from ringtrain.cli.train import main
from ringtrain.data.prepare import prepare
from ringtrain.data.sampler import DistributedSampler
from ringtrain.data.tokens import TokenWindows, load_tokens

TEXT = "".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs.\n"
               for i in range(120))


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    prepare(str(tmp_path / "t.txt"), str(tmp_path / "d"), progress=False)
    return tmp_path / "d"


def test_windows_are_memory_mapped_not_loaded(data_dir):
    data = load_tokens(str(data_dir), 16)
    train = data.train_set
    assert train._tokens is None  # nothing read before a window is asked for
    x, y = train[5]
    assert isinstance(train.tokens, __import__("numpy").memmap)
    assert x.dtype == torch.long and data.decode(x.tolist()) == TEXT[5:21]
    assert data.decode(y.tolist()) == TEXT[6:22]
    clone = pickle.loads(pickle.dumps(train))  # a worker process maps the file itself
    assert clone._tokens is None and torch.equal(clone[5][0], x)
    capped = TokenWindows(str(data_dir / "val.bin"), "uint16", 4, stride=4, max_windows=10)
    assert len(capped) == 10 and capped.start(0) == 0
    assert capped.start(9) == (capped.n_windows - 1) * 4


def test_resume_mid_epoch_on_another_number_of_ranks_is_exact(data_dir):
    """2 ranks take 7 windows each, then 3 ranks resume: together they see the epoch's global
    order of windows (1 rank's), each window once, no matter the split."""
    ds = load_tokens(str(data_dir), 16).train_set
    reference = list(DistributedSampler(ds, num_replicas=1, rank=0, seed=3))
    two = [DistributedSampler(ds, num_replicas=2, rank=r, seed=3) for r in range(2)]
    its = [iter(s) for s in two]
    first = [[next(it) for _ in range(7)] for it in its]
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["samples_consumed"] == 14
    taken = [first[r][i] for i in range(7) for r in range(2)]  # interleaved: the global order
    assert taken == reference[:14]
    three = [DistributedSampler(ds, num_replicas=3, rank=r, seed=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    rest = [list(s) for s in three]
    n = len(reference) - 14
    resumed = [rest[i % 3][i // 3] for i in range(n)]
    assert resumed == reference[14:]
    assert sorted(taken + resumed) == list(range(len(ds)))  # every window once
    for i in (taken[0], resumed[-1]):  # and what a window holds does not depend on the sampler
        assert torch.equal(ds[i][0], torch.tensor(ds.tokens[i:i + 16].astype("int64")))


def test_one_and_two_processes_report_the_same_validation_loss(data_dir, tmp_path, clean_env):
    common = ["--data", str(data_dir), "--block-size", "16", "--steps", "3", "--n-layer", "1",
              "--n-embd", "32", "--sample-length", "10", "--no-progress", "--threads", "1",
              "--eval-batch-size", "16", "--no-report"]
    assert main([*common, "--batch-size", "8", "--run-dir", str(tmp_path / "one")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", *common, "--batch-size", "4",
         "--nproc-per-node", "2", "--run-dir", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert two["world_size"] == 2 and two["global_batch_size"] == one["global_batch_size"] == 8
    # The same fixed windows (all non-overlapping ones of the split), split exactly over ranks;
    # only the float summation order differs.
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)


def test_a_block_larger_than_the_validation_split_is_refused(
    data_dir, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(["--data", str(data_dir), "--block-size", "4096"]) == 2
    err = capsys.readouterr().err
    assert "val.bin has" in err and "fewer than one window of --block-size + 1 = 4097" in err
    assert main(["--data", str(tmp_path)]) == 2  # a directory that is not a prepared dataset
    assert "run `ringtrain prepare SRC" in capsys.readouterr().err


def test_uint32_token_files_for_large_vocabularies(tmp_path):
    from ringtrain.data.prepare import token_dtype

    assert (token_dtype(65_536), token_dtype(65_537)) == ("uint16", "uint32")
    ids = __import__("numpy").arange(70_000, 70_100, dtype="uint32")
    ids.tofile(tmp_path / "train.bin")
    windows = TokenWindows(str(tmp_path / "train.bin"), "uint32", 8)
    assert len(windows) == 92 and windows[3][0].tolist() == list(range(70_003, 70_011))


def test_ranks_preparing_one_text_at_once_all_read_it(tmp_path):
    """`--data FILE.txt` on 2 ranks failed once (rank 1: "No such file or directory:
    .../data/train.bin"): each rank prepared its own copy, and one that found another's already
    in place took it for an older preparation and deleted it under that rank's reader (this
    test: 2 failures in 3 before the fix). Threads here: the turns are an flock per open, which
    threads contend for as processes do."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from ringtrain.data.tokens import load_tokens, prepare_text_in

    (tmp_path / "t.txt").write_text(TEXT)
    text, n = str(tmp_path / "t.txt"), 8

    def rank(run_dir: str, barrier: Barrier) -> int:
        barrier.wait(timeout=60)
        data = load_tokens(prepare_text_in(text, run_dir), 16)
        return int(data.train_set[len(data.train_set) - 1][1][-1])  # reads train.bin's end

    for attempt in range(20):
        run_dir, barrier = str(tmp_path / f"run{attempt}"), Barrier(n)
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(rank, [run_dir] * n, [barrier] * n))
        assert len(set(got)) == 1, got
        assert sorted(os.listdir(run_dir)) == ["data"]


def test_a_changed_text_keeps_the_characters_a_run_to_resume_reads(tmp_path):
    """RUN_DIR/data is prepared again when the text changes; where a run there is to be
    resumed (`keep_chars`), a text of other characters is refused and the earlier preparation
    stays (it was replaced, and the refused resume left snapshots whose ids nothing decoded)."""
    from ringtrain.data.tokens import prepare_text_in, read_meta

    text, run_dir = tmp_path / "t.txt", str(tmp_path / "run")
    text.write_text(TEXT)
    out = prepare_text_in(str(text), run_dir)
    chars = read_meta(out)["chars"]
    text.write_text(TEXT + TEXT[:40])  # more text, the same characters: prepared again
    assert read_meta(prepare_text_in(str(text), run_dir, keep_chars=True))["chars"] == chars
    before = (tmp_path / "run" / "data" / "train.bin").read_bytes()
    text.write_text(TEXT + "XYZ\n")
    with pytest.raises(ValueError, match=r"--data .*t\.txt changed since this run prepared it "
                                         r"into .*data, and its characters with it \(\d+ then, "
                                         r"\d+ now; new: 'XYZ'\).*--no-resume"):
        prepare_text_in(str(text), run_dir, keep_chars=True)
    assert (tmp_path / "run" / "data" / "train.bin").read_bytes() == before
    assert sorted(os.listdir(run_dir)) == ["data"]  # no preparation left behind
    assert len(read_meta(prepare_text_in(str(text), run_dir))["chars"]) == len(chars) + 3
