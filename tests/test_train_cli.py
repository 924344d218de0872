"""`ringtrain train` end to end (2 processes through the launcher) and its option errors."""

import json
import os
import re
import subprocess
import sys

import pytest
from test_exit import ABORTED

from ringtrain.cli.train import main
from ringtrain.cli.train_args import check_args, options_from, parse_options
from ringtrain.strategies.ps_config import ASYNC_BETA1
from ringtrain.training.progress import setup_logging

SUMMARY_KEYS = ("steps", "world_size", "strategy", "train_loss", "eval_loss", "eval_accuracy",
                "tokens_per_s", "wall_s", "restarts", "param_sha256")
TINY = ["--steps", "20", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
        "--eval-every", "10", "--no-progress"]


# tests/conftest.py: in-process runs leave no trace
pytestmark = pytest.mark.usefixtures("clean_env")


def test_two_processes_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Exits cleanly too: test_exit.py repeats this run under load only at full size.
    assert not any(s in proc.stdout + proc.stderr for s in ABORTED), proc.stderr[-3000:]
    files = set(os.listdir(run_dir)) - {"tensorboard"}  # there when the package is installed
    assert sorted(files) == [".lock", ".options.json", "config.json", "metrics.jsonl",
                             "model.safetensors", "model_config.json", "report.png", "snapshots",
                             "summary.json"]
    # 20 steps at --snapshot-every 100: the last step's snapshot, so the run can go on
    assert os.listdir(run_dir / "snapshots") == ["snap-00000020"]
    assert (run_dir / ".lock").read_text().startswith("pid ")  # rank 0's, while it trained
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert (summary["steps"], summary["world_size"], summary["strategy"]) == (20, 2, "ddp")
    assert summary["restarts"] == 0 and len(summary["param_sha256"]) == 64
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and "nproc_per_node" not in config["args"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 20
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert proc.stdout.count("summary:") == 1  # rank 0 alone prints it
    assert "param_sha256 differs" not in proc.stderr
    # The same run with another option is refused, and leaves the run's config.json (the
    # launcher wrote the workers' options into it, over the run's, before they refused).
    before = (run_dir / "config.json").read_bytes()
    again = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--n-embd", "16", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert again.returncode == 2 and "--n-embd 32 in the snapshot, 16 now" in again.stderr
    assert (run_dir / "config.json").read_bytes() == before


def test_text_data_single_process(tmp_path, capsys):
    data = tmp_path / "poem.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 30)
    run_dir = tmp_path / "run"
    rc = main(["--data", str(data), "--block-size", "16", "--steps", "6", "--n-layer", "1",
               "--n-embd", "32", "--batch-size", "8", "--sample-length", "40", "--no-progress",
               "--threads", "1", "--run-dir", str(run_dir)])
    assert rc == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] > 0 and "eval_accuracy" not in summary
    assert len(summary["sample"]) == 41 and "sample:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "argument --batch-size: 0 is not allowed: it must be 1 or more"),
    (["--strategy", "nope"], "--strategy: invalid choice: 'nope'"),
    (["--data", "/nonexistent/input.txt"], "--data /nonexistent/input.txt: no such file"),
    (["--pp", "2", "--strategy", "ddp"], "--pp applies to --strategy pipeline, not ddp"),
    (["--pp", "2"], r"world_size=1 is not divisible by pp=2"),  # --pp chose pipeline
    (["--pp", "2", "--tp", "2", "--nproc-per-node", "2"],
     r"world_size=2 is not divisible by pp=2 x tp=2: .*--nproc-per-node 4 "),
    (["--pp", "2", "--sequence-parallel", "--nproc-per-node", "2"],
     "--sequence-parallel shards the sequence over the tp ranks: add --tp 2"),
    (["--servers", "1", "--strategy", "pipeline"],
     "--servers applies to --strategy ps, not pipeline"),
    (["--n-embd", "30", "--n-head", "4"], "--n-embd 30 is not divisible by --n-head 4"),
    (["--digits", "5"], "supports 1..3"),
    (["--beta1", "1"], r"--beta1 1.0: Adam's momentum must be in \[0, 1\)"),
    (["--lr", "0"], "--lr 0.0: it must be positive"),
    (["--strategy", "tp", "--nproc-per-node", "3"], r"world_size=3 is not divisible by tp=2"),
    (["--pp", "2", "--tp", "2", "--nproc-per-node", "4", "--recompute-gather"],
     "--recompute-gather gathers the sequence-parallel column layers' input again"),
    (["--strategy", "tp", "--nproc-per-node", "2", "--recompute-gather"],
     "--recompute-gather gathers the sequence-parallel column layers' input again in backward: "
     "add --sequence-parallel, or drop it"),
    (["--strategy", "tp", "--nproc-per-node", "2", "--n-head", "3", "--n-embd", "48"],
     r"--n-head 3 is not divisible by --tp 2: .*use --tp in \[1, 3\]"),
    # The workers found these one by one, in their first forward (a ValueError on each rank).
    (["--strategy", "tp", "--nproc-per-node", "2", "--sequence-parallel", "--digits", "1"],
     r"--sequence-parallel splits each sample's 3 tokens over the --tp 2 ranks, and 3 is not a "
     r"multiple of 2: make it a multiple of 2 \(--block-size with --data, 3 x --digits"),
    (["--pp", "2", "--tp", "4", "--nproc-per-node", "8", "--sequence-parallel", "--digits", "1",
      "--pad-vocab", "4"],
     r"3 is not a multiple of 4: make it"),  # n_head 4: --tp 3 would not split the heads
    # The addition task's 10 digits: the workers' first shard_rows said "pad the vocabulary",
    # with no flag to do it.
    (["--strategy", "tp", "--tp", "4", "--nproc-per-node", "4"],
     r"--tp 4 splits the vocabulary's rows over the tp ranks, and the model has 10 \(the data's "
     r"tokens\), not a multiple of 4: add --pad-vocab 4 \(.*\), or use --tp in \[2\]"),
    (["--pp", "2", "--tp", "4", "--nproc-per-node", "8"],
     r"--tp 4 splits the vocabulary's rows .*: add --pad-vocab 4 "),
    # pp x chunks per rank stages, found before launch: the workers' words named --pp alone
    # ("use --pp 3 or fewer") and the GPT's layers, not --n-layer.
    (["--pp", "2", "--nproc-per-node", "2", "--schedule", "zb-v", "--n-layer", "1"],
     r"--pp 2 with 2 model chunks per rank \(--schedule zb-v\) makes 4 stages, but --n-layer 1 "
     r"gives the GPT 3 layers .*Use --schedule 1f1b \(one stage per rank\), a smaller --pp, or "
     r"--n-layer 2 or more"),
    (["--pp", "2", "--nproc-per-node", "2", "--schedule", "interleaved", "--virtual-stages", "4",
      "--n-layer", "2"], r"makes 8 stages, but --n-layer 2 gives the GPT 4 layers .*Use "
     r"--virtual-stages 1, a smaller --pp, or --n-layer 6 or more"),
    (["--pp", "4", "--nproc-per-node", "4", "--n-layer", "1"],
     r"--pp 4 makes 4 stages, but --n-layer 1 gives the GPT 3 layers"),
    (["--strategy", "tp", "--tp", "4", "--nproc-per-node", "4", "--pad-vocab", "5"],
     r"has 10 \(the data's tokens, padded to a multiple of 5\), not a multiple of 4: use "
     r"--pad-vocab 20 "),
])
def test_bad_options_exit_2_with_the_reason(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "runs").exists()  # nothing created for a rejected command


def test_help_and_defaults():
    assert main(["--help"]) == 0
    opts = parse_options([])
    check_args(opts)
    assert (opts.run.strategy, opts.launch.nproc_per_node, opts.data.digits,
            opts.trainer.dtype) == ("ddp", 1, 2, "fp32")


def test_async_parameter_server_lowers_adam_momentum_unless_told():
    for argv, beta1 in ([[], 0.9], [["--strategy", "ps", "--ps-mode", "ssp"], 0.9],
                        [["--strategy", "ps", "--ps-mode", "async"], ASYNC_BETA1],
                        [["--strategy", "ps", "--ps-mode", "async", "--beta1", "0.8"], 0.8]):
        opts = parse_options(argv)
        check_args(opts)
        assert opts.trainer.resolved().beta1 == beta1, argv


def test_strategy_options_only_for_the_chosen_strategy():
    opts = parse_options(["--strategy", "pipeline", "--pp", "2", "--schedule", "gpipe"])
    assert opts.strategy.kwargs() == {"pp": 2, "schedule": "gpipe", "microbatches": None,
                                      "virtual_stages": 1, "tp": 1, "sequence_parallel": False,
                                      "recompute_gather": False}
    # --pp without --strategy chooses pipeline; --tp then splits each stage (issue 27).
    opts = parse_options(["--pp", "2", "--tp", "2"])
    assert (opts.run.strategy, opts.strategy.kwargs()["tp"]) == ("pipeline", 2)
    assert parse_options(["--tp", "2"]).run.strategy == "tp"
    opts = parse_options(["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "0"])
    # servers: its default
    assert opts.strategy.kwargs() == {"servers": 1, "mode": "ssp", "staleness": 0}


def test_the_workers_options_round_trip_through_the_options_file():
    opts = parse_options(["--nproc-per-node", "2", "--max-restarts", "1", "--lr", "0.01",
                          "--tie-embeddings", "--no-bias", "--run-dir", "x", "--trace-steps", "3:5",
                          "--strategy", "ps", "--ps-mode", "async"])
    flat = json.loads(json.dumps(opts.flat()))  # what the launcher writes into .options.json
    assert "nproc_per_node" not in flat and "max_restarts" not in flat  # the launcher's own
    again = options_from(flat, parse_text=True)
    assert again.flat() == opts.flat() and again.trainer == opts.trainer
    assert ((again.model.bias, again.run.trace_steps, again.strategy)
            == (False, opts.run.trace_steps, opts.strategy))


def test_task_defaults_and_recipes_in_order(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 400)
    opts = parse_options(["--data", str(text)])
    assert (opts.model.n_layer, opts.trainer.beta2, opts.data.block_size) == (4, 0.99, 64)
    opts = parse_options(["--data", str(text), "--recipe", "shakespeare_char", "--n-layer", "2"])
    assert (opts.model.n_layer, opts.model.n_embd, opts.model.bias, opts.trainer.beta2,
            opts.trainer.steps) == (2, 384, False, 0.99, 5000)  # the command line wins
    assert parse_options([]).trainer.beta2 == 0.95  # the demo's addition default stays
    bad = tmp_path / "bad.py"
    bad.write_text("n_layers = 3\n")
    with pytest.raises(ValueError, match="n_layers is not an option"):
        parse_options(["--recipe", str(bad)])


def test_library_errors_are_said_with_flags():
    with pytest.raises(ValueError, match=r"^--n-embd 30 is not divisible by --n-head 4; choose "
                                         r"--n-embd as a multiple of --n-head"):
        parse_options(["--n-embd", "30"])
    with pytest.raises(ValueError, match=r"^--min-lr 1\.0 is above the peak lr"):
        check_args(parse_options(["--min-lr", "1"]))


def test_messages_carry_the_rank_and_only_rank_0_logs_info(capsys):
    log = setup_logging(3)
    log.warning("disk almost full")
    log.info("not shown on rank 3")
    setup_logging(0).info("shown on rank 0")
    err = capsys.readouterr().err
    assert "[rank 3] disk almost full" in err and "[rank 0] shown on rank 0" in err
    assert "not shown" not in err
