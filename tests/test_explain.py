"""`ringtrain explain RUN_DIR`: on a real 2-rank run, on hand-made run files, and on bad dirs.

    .venv/bin/pytest -q tests/test_explain.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ringtrain.cli.explain import RunFiles, explain, load_run, main
from ringtrain.data.addition import train_size
from ringtrain.models import GPT, GPTConfig

TINY = ["--steps", "20", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
        "--eval-every", "10", "--no-progress", "--snapshot-every", "10"]
MODEL = {"vocab_size": 10, "block_size": 6, "n_layer": 1, "n_head": 4, "n_embd": 32,
         "dropout": 0.0, "tie_embeddings": False, "bias": True}


def _params(model: dict) -> int:
    return sum(p.numel() for p in GPT(GPTConfig(**model)).parameters())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One tiny `ringtrain train` on 2 processes, with snapshots at steps 10 and 20."""
    tmp = tmp_path_factory.mktemp("explain")
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
         "--run-dir", str(tmp / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "run"


def test_explains_a_two_rank_ddp_run(run_dir):
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "explain", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # the text is wrapped: compare it unwrapped
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    params = _params(config["model"])
    assert "--strategy ddp on 2 ranks" in text
    assert f"2 ranks, each a full replica of the GPT ({params:,} parameters each)" in text
    n = train_size(2)
    assert f"{n:,} training samples" in text and f"2 data ranks (every rank) x {n // 2:,}" in text
    assert "no padding" in text
    # Ring all-reduce on 2 ranks: each sends 2(N-1)/N = 1 x the fp32 gradient buffer.
    assert f"fp32: {params * 4:,} bytes" in text and f"= {params * 4:,} bytes per step" in text
    assert f"compute {summary['compute_s_per_step'] * 1e3:.2f} ms" in text
    assert f"communication {summary['comm_s_per_step'] * 1e3:.2f} ms" in text
    assert f"{run_dir}/snapshots/snap-00000020: step 20 of 20" in text
    assert "on any number of ranks" in text  # a DDP snapshot holds the whole state
    assert f"--run-dir {run_dir} " in text  # the resume command names this directory


def test_a_corrupt_newest_snapshot_is_skipped(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shared = copy / "snapshots" / "snap-00000020" / "shared.pt"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    assert main([str(copy)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "skipped:" in text and "snap-00000020/shared.pt: sha256" in text
    assert f"{copy}/snapshots/snap-00000010: step 10 of 20" in text


def _run(world: int, strategy: str = "ddp", summary: dict | None = None, **args) -> RunFiles:
    config = {"task": "addition", "world_size": world, "model": MODEL,
              "args": {"strategy": strategy, "digits": 2, "snapshot_every": 100, **args},
              "trainer": {"steps": 50, "batch_size": 16, "grad_accum": 1}}
    return RunFiles("runs/x", config, summary, train_samples=train_size(2), eval_samples=500)


def _text(run: RunFiles) -> str:
    return " ".join(explain(run).split())


def test_ddp_on_three_ranks_pads_and_moves_four_thirds_of_the_gradients():
    text = _text(_run(3))
    params = _params(MODEL)
    assert "3 data ranks (every rank) x 3,167 samples" in text  # ceil(9,500 / 3)
    assert "padded with 1 sample repeated" in text  # 3 x 3,167 = 9,501
    assert f"2(N-1)/N = 1.33 x the buffer (N = 3) = {4 / 3 * params * 4:,.0f} bytes" in text
    assert "did not finish (no summary.json)" in text
    assert "the run ended before step 100" in text and "start from step 0" in text


def test_compressed_gradients_send_fewer_bytes():
    params = _params(MODEL)
    assert f"in bf16: {params * 2:,} bytes" in _text(_run(2, grad_compress="bf16"))
    summary = {"steps": 50, "train_loss": 1.0, "powersgd_bytes_sent": 50 * 1000}
    text = _text(_run(2, summary=summary, grad_compress="powersgd:2"))
    assert "PowerSGD (--grad-compress powersgd:2)" in text and "1,000 bytes sent per rank" in text
    assert f"{params * 4 / 1000:.1f} x fewer" in text


def test_pipeline_roles_are_stages_times_replicas():
    text = _text(_run(4, "pipeline", pp=2))
    assert "4 ranks = 2 pipelines x 2 stages" in text
    assert "pipeline 1: stage 0 on rank 2, stage 1 on rank 3" in text
    assert "2 data ranks (the stages of a pipeline read the same shard)" in text
    assert "as 8 micro-batches of 2 (--schedule 1f1b)" in text  # the most up to 4 x pp dividing 16
    # 16 samples x 6 tokens x 32 channels x 4 bytes cross each stage boundary, each way.
    assert "estimate:" in text and f"= {16 * 6 * 32 * 4:,} bytes forward" in text


def test_parameter_server_roles_traffic_and_staleness():
    summary = {"steps": 50, "train_loss": 1.5, "restarts": 0, "param_sha256": "ab" * 32,
               "staleness_max": 1, "staleness_mean": 0.25, "update_lag_max": 2, "update_lag_mean": 1.0}
    text = _text(_run(3, "ps", summary, servers=1, ps_mode="async"))
    assert "2 workers (ranks 0..1) compute gradients" in text
    assert "1 parameter server (rank 2) holds the parameters" in text and "Mode async" in text
    assert "2 data ranks (the workers; servers read none)" in text
    grad = _params(MODEL) * 4
    assert f"each server receives {2 * grad:,} bytes per step" in text
    assert "staleness" in text and "max 1, mean 0.25" in text


def test_zero_says_what_each_rank_holds_and_sends():
    params = _params(MODEL)
    text = _text(_run(2, "zero", zero_stage="3"))
    assert "holding 1/2 of the AdamW moments, the gradients and the parameters (stage 3)" in text
    assert f"{params * 2:,} bytes of parameters" in text  # 4 bytes / 2 ranks
    assert f"{3 * 0.5 * params * 4:,.0f} bytes sent per rank per step" in text  # 3 x (N-1)/N
    text = _text(_run(2, "zero", zero_stage="1"))
    assert "as many bytes as DDP's one all-reduce" in text and "0 / 0" not in text


def test_local_sgd_and_diloco_meet_every_h_steps():
    params = _params(MODEL)
    summary = {"steps": 50, "train_loss": 1.0, "meetings": 5, "meeting_bytes_sent": 12345}
    text = _text(_run(2, "localsgd", summary, sync_every=10))
    assert "training alone on its own shard for 10 steps (--sync-every 10)" in text
    assert f"at each meeting {params * 4:,} bytes sent per rank" in text  # 2(N-1)/N = 1 at N = 2
    assert "12,345 bytes sent by rank 0 over 5 meetings" in text
    text = _text(_run(3, "diloco", sync_every=50, outer_compress="int8"))
    assert "pseudo-gradient" in text and "all-gathered in int8 with one fp32 scale" in text
    assert f"at each meeting {params * 2:,} bytes sent per rank" in text  # 1 byte x (N-1)
    assert "--outer-lr 0.7, --outer-momentum 0.9" in text


def test_every_registered_strategy_explains_itself_in_its_own_words():
    from ringtrain.cli.explain_words import WORDS
    from ringtrain.strategies import registered

    for name in registered():
        assert name in WORDS, name
        text = _text(_run(2, name))
        assert "not estimated" not in text and "as the strategy plans" not in text, (name, text)


def test_an_unknown_strategy_is_still_explained():
    text = _text(_run(2, "someday"))
    assert "--strategy someday: not known to this ringtrain" in text
    assert "not estimated for --strategy someday" in text


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: (p / "file").write_text("x") and p / "file", "not a directory"),
    (lambda p: p, "has no config.json"),
    (lambda p: (p / "config.json").write_text("{not json") and p, "config.json: cannot read it"),
    (lambda p: (p / "config.json").write_text("{}") and p, "is not the config.json of"),
])
def test_a_bad_run_dir_is_one_line_and_exit_2(make, message, tmp_path, capsys):
    path = make(tmp_path)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ringtrain explain: error: ") and message in err
    with pytest.raises(ValueError, match=message):
        load_run(path)


def test_the_command_lists_explain():
    out = subprocess.run([sys.executable, "-m", "ringtrain", "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "explain" in out.stdout
