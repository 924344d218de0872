"""`ringtrain explain RUN_DIR`: on a real 2-rank run, on hand-made run files, and on bad dirs.

    .venv/bin/pytest -q tests/test_explain.py

The figures (bytes held and sent, the pipeline's bubble, the parameter server's staleness) are
checked as numbers, each against its formula computed here; the text is only checked to carry
them, formatted (`nbytes`), and to take the right branch. CPU only (the real run uses gloo).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from ringtrain.cli.explain import RunFiles, data_split, explain, load_run, main, run_facts
from ringtrain.cli.explain_words import WORDS, nbytes
from ringtrain.data.addition import train_size
from ringtrain.models import GPT, GPTConfig
from ringtrain.strategies import registered
from ringtrain.strategies.figures import Workload
from ringtrain.strategies.layouts import whole_numel

TINY = ["--steps", "20", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
        "--eval-every", "10", "--no-progress", "--no-report", "--snapshot-every", "10"]
MODEL = {"vocab_size": 10, "block_size": 6, "n_layer": 1, "n_head": 4, "n_embd": 32,
         "dropout": 0.0, "tie_embeddings": False, "bias": True}
SAMPLES = train_size(2)  # the addition task's training sums at 2 digits (9,500)


def _params(model: dict) -> int:
    return sum(p.numel() for p in GPT(GPTConfig(**model)).parameters())


P = _params(MODEL)  # the hand-made runs' model
FP32 = 4 * P  # its parameters (or gradients) in fp32, bytes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One tiny `ringtrain train` on 2 processes (CPU, gloo), with snapshots at steps 10, 20."""
    tmp = tmp_path_factory.mktemp("explain")
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", "--device", "cpu",
         *TINY, "--run-dir", str(tmp / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "run"


def test_explains_a_two_rank_ddp_run(run_dir, capsys):
    # In-process: `ringtrain explain` is this main, and reading a run starts no process.
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the text is wrapped: compare it unwrapped
    run = load_run(run_dir)
    facts, summary = run_facts(run), run.summary
    params = _params(run.config["model"])
    assert (facts.name, facts.world, facts.params) == ("ddp", 2, params)
    split = data_split(run, facts)
    assert (split.samples, split.data_ranks, split.per_rank, split.padding) == (
        SAMPLES, 2, SAMPLES // 2, 0)
    # Ring all-reduce on 2 ranks: each sends 2(N-1)/N = 1 x the fp32 gradient buffer.
    fig = facts.figures
    assert fig.wire == "fp32" and fig.buffer_bytes == params * 4
    assert fig.sent_bytes == pytest.approx(params * 4)
    assert fig.held_bytes == 16 * params  # fp32 parameters, gradients, AdamW's two moments
    assert (run.resume_step, run.resume_path) == (20, f"{run_dir}/snapshots/snap-00000020")
    assert run.resume_replicated is True  # a DDP snapshot holds the whole state
    # The text carries the figures.
    assert "--strategy ddp on 2 ranks" in text and f"({params:,} parameters each)" in text
    assert f"{SAMPLES:,} training samples" in text
    assert f"2 data ranks (every rank) x {SAMPLES // 2:,} samples" in text
    assert "no padding" in text
    assert f"fp32: {nbytes(fig.buffer_bytes)}" in text
    assert f"= {nbytes(fig.sent_bytes)} per step" in text
    assert f"{nbytes(fig.held_bytes)} (fp32 AdamW" in text
    assert f"compute {summary['compute_s_per_step'] * 1e3:.2f} ms" in text
    assert f"communication {summary['comm_s_per_step'] * 1e3:.2f} ms" in text
    assert f"{run_dir}/snapshots/snap-00000020: step 20 of 20" in text
    assert "on any number of ranks" in text  # the replicated branch
    assert f"--run-dir {run_dir} " in text  # the resume command names this directory


def test_a_corrupt_newest_snapshot_is_skipped(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shared = copy / "snapshots" / "snap-00000020" / "shared.pt"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    run = load_run(copy)
    assert (run.resume_step, run.snapshots) == (10, 2)
    assert len(run.skipped) == 1 and "snap-00000020/shared.pt: sha256" in run.skipped[0]
    assert main([str(copy)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(f"skipped: {run.skipped[0]}".split()) in text  # why, as load_run found it
    assert f"{copy}/snapshots/snap-00000010: step 10 of 20" in text


def _run(world: int, strategy: str = "ddp", summary: dict | None = None, grad_accum: int = 1,
         **args) -> RunFiles:
    config = {"task": "addition", "world_size": world, "model": MODEL,
              "args": {"strategy": strategy, "digits": 2, "snapshot_every": 100, **args},
              "trainer": {"steps": 50, "batch_size": 16, "grad_accum": grad_accum}}
    return RunFiles("runs/x", config, summary, train_samples=SAMPLES, eval_samples=500)


def _text(run: RunFiles) -> str:
    return " ".join(explain(run).split())


def test_ddp_on_three_ranks_pads_and_moves_four_thirds_of_the_gradients():
    run = _run(3)
    facts = run_facts(run)
    split = data_split(run, facts)
    assert split.per_rank == math.ceil(SAMPLES / 3) == 3_167
    assert split.padding == 3 * 3_167 - SAMPLES == 1
    assert split.global_batch == 16 * 3 and split.steps == 50
    assert split.steps_per_epoch == 3_167 // 16 and split.epochs == pytest.approx(50 / 197)
    fig = facts.figures
    assert fig.ring_share == pytest.approx(2 * (3 - 1) / 3)
    assert fig.sent_bytes == pytest.approx(4 / 3 * FP32)
    text = _text(run)
    assert f"3 data ranks (every rank) x {split.per_rank:,} samples" in text
    assert f"padded with {split.padding} sample repeated" in text
    assert f"2(N-1)/N = {fig.ring_share:.3g} x the buffer (N = 3) = {nbytes(fig.sent_bytes)}" \
        in text
    assert run.summary is None and run.resume_step is None
    assert "did not finish (no summary.json)" in text
    assert "the run ended before step 100" in text and "start from step 0" in text


def test_one_ddp_rank_sends_nothing():
    fig = run_facts(_run(1)).figures
    assert fig.sent_bytes == 0 and fig.held_bytes == 16 * P and fig.data_ranks == 1
    assert "nothing: one rank has no one to send to" in _text(_run(1))


def test_compressed_gradients_send_fewer_bytes():
    fig = run_facts(_run(2, grad_compress="bf16")).figures
    assert (fig.wire, fig.buffer_bytes) == ("bf16", 2 * P)
    assert fig.sent_bytes == pytest.approx(2 * P)  # 2(N-1)/N = 1 at N = 2
    assert f"in bf16: {nbytes(2 * P)}" in _text(_run(2, grad_compress="bf16"))
    summary = {"steps": 50, "train_loss": 1.0, "powersgd_bytes_sent": 50 * 1000}
    run = _run(2, summary=summary, grad_compress="powersgd:2")
    fig = run_facts(run).figures
    # PowerSGD's factors depend on the matrices' shapes: counted in the run, not estimated.
    assert fig.wire == "powersgd" and fig.buffer_bytes is None and fig.sent_bytes is None
    assert fig.dense_sent_bytes == pytest.approx(FP32)
    text = _text(run)
    assert "PowerSGD (--grad-compress powersgd:2)" in text and "1,000 bytes sent per rank" in text
    assert f"{FP32 / 1000:.1f} x fewer" in text


def test_pipeline_roles_bubble_and_activations():
    run = _run(4, "pipeline", pp=2)
    facts = run_facts(run)
    fig = facts.figures
    assert (fig.pp, fig.dp, fig.data_ranks) == (2, 2, 2)
    assert fig.pipelines == ((0, 1), (2, 3))  # rank = dp_rank x pp + pp_rank
    assert (fig.microbatches, fig.microbatch_size) == (8, 2)  # the most up to 4 x pp dividing 16
    assert fig.bubble == pytest.approx((2 - 1) / (8 + 2 - 1))  # (p-1)/(m+p-1)
    # 16 samples x 6 tokens x 32 channels x 4 bytes cross each stage boundary, each way.
    assert fig.boundary_bytes == 16 * 6 * 32 * 4
    assert fig.stage_params == P / 2 and fig.held_bytes == pytest.approx(16 * P / 2)
    assert fig.dp_sent_bytes == pytest.approx(2 * (2 - 1) / 2 * FP32 / 2)  # ring among 2
    assert fig.sent_bytes == pytest.approx(fig.boundary_bytes + fig.dp_sent_bytes)
    assert data_split(run, facts).data_ranks == 2
    text = _text(run)
    assert "4 ranks = 2 pipelines x 2 stages" in text
    assert "pipeline 1: stage 0 on rank 2, stage 1 on rank 3" in text
    assert "2 data ranks (the stages of a pipeline read the same shard)" in text
    assert "as 8 micro-batches of 2 (--schedule 1f1b)" in text
    assert f"= {fig.bubble:.1%} of it" in text and f"{1 / 9:.1%}" == "11.1%"
    assert "estimate:" in text and f"= {nbytes(fig.boundary_bytes)} forward" in text
    assert f"about {nbytes(fig.dp_sent_bytes)} sent per rank" in text
    assert f"in all: {nbytes(fig.sent_bytes)} sent per step" in text


@pytest.mark.parametrize("world,pp,options,m", [
    (4, 4, {}, 16),  # 4 x pp = 16 divides the 16 samples
    (2, 2, {"microbatches": 4, "schedule": "gpipe"}, 4),
    (3, 3, {}, 8),  # 12 does not divide 16: the most below it that does
])
def test_pipeline_bubble_follows_the_micro_batches(world, pp, options, m):
    fig = run_facts(_run(world, "pipeline", pp=pp, **options)).figures
    assert fig.microbatches == m and fig.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    # A middle stage sends activations forward and gradients backward; dp = 1: no all-reduce.
    assert fig.dp_sent_bytes == 0
    assert fig.sent_bytes == pytest.approx(min(2, pp - 1) * 16 * 6 * 32 * 4)


def test_pipeline_options_that_do_not_fit_get_the_generic_words():
    run = _run(3, "pipeline", pp=2)  # 2 stages do not divide 3 ranks
    facts = run_facts(run)
    assert facts.figures is None and facts.data_ranks == 3
    assert "world_size=3 is not divisible by pp=2" in facts.refused
    assert f"not estimated for --strategy pipeline ({facts.refused})" in _text(run)


def test_parameter_server_roles_traffic_and_staleness():
    summary = {"steps": 50, "train_loss": 1.5, "restarts": 0, "param_sha256": "ab" * 32,
               "staleness_max": 1, "staleness_mean": 0.25, "update_lag_max": 2,
               "update_lag_mean": 1.0}
    run = _run(3, "ps", summary, servers=1, ps_mode="async")
    fig = run_facts(run).figures
    assert (fig.workers, fig.servers, fig.data_ranks) == (2, 1, 2)
    assert (fig.worker_ranks, fig.server_ranks) == ((0, 1), (2,))  # the servers come last
    assert fig.staleness_bound is None  # async: nothing bounds it
    assert fig.update_lag == 2 - 1  # with equal speeds, the other W-1 workers push once each
    assert fig.sent_bytes == FP32 and fig.pull_bytes == FP32  # push gradients, pull parameters
    assert fig.server_received_bytes == 2 * FP32  # every worker's push, one server
    assert fig.held_bytes == 2 * FP32 and fig.server_held_bytes == 16 * P
    text = _text(run)
    assert "2 workers (ranks 0..1) compute gradients" in text
    assert "1 parameter server (rank 2) holds the parameters" in text and "Mode async" in text
    assert "2 data ranks (the workers; servers read none)" in text
    assert f"each server receives {nbytes(fig.server_received_bytes)} per step" in text
    assert f"update lag about {fig.update_lag:g}" in text
    assert "staleness" in text and "max 1, mean 0.25" in text  # observed, from summary.json


@pytest.mark.parametrize("mode,bound,lag", [("sync", 0, 0), ("ssp", 3, None)])
def test_parameter_server_staleness_bound_by_mode(mode, bound, lag):
    fig = run_facts(_run(5, "ps", servers=2, ps_mode=mode, staleness=3)).figures
    assert (fig.staleness_bound, fig.update_lag) == (bound, lag)
    assert (fig.worker_ranks, fig.server_ranks) == ((0, 1, 2), (3, 4))
    assert fig.workers == 3 and fig.server_received_bytes == pytest.approx(3 * FP32 / 2)
    assert fig.server_held_bytes == pytest.approx(16 * P / 2)


@pytest.mark.parametrize("world,stage", [(2, 3), (4, 3), (2, 2), (3, 1)])
def test_zero_holds_one_nth_of_what_it_shards(world, stage):
    fig = run_facts(_run(world, "zero", zero_stage=str(stage))).figures
    assert fig.params_bytes == pytest.approx(FP32 / world if stage == 3 else FP32)
    assert fig.grads_bytes == pytest.approx(FP32 / world if stage >= 2 else FP32)
    assert fig.optimizer_bytes == pytest.approx(8 * P / world)  # AdamW's moments, always sharded
    assert fig.replica_bytes == 16 * P


def test_zero_says_what_each_rank_holds_and_sends():
    run = _run(2, "zero", zero_stage="3")
    fig = run_facts(run).figures
    assert fig.collectives == 3  # all-gather for forward, for backward; one reduce-scatter
    assert fig.sent_bytes == pytest.approx(3 * (2 - 1) / 2 * FP32)  # 3 x (N-1)/N of the model
    text = _text(run)
    assert "holding 1/2 of the AdamW moments, the gradients and the parameters (stage 3)" in text
    assert f"{nbytes(FP32 / 2)} of parameters" in text  # 4 bytes / 2 ranks
    assert f"{nbytes(fig.held_bytes)}, against {nbytes(16 * P)} for a DDP replica" in text
    assert f"{nbytes(fig.sent_bytes)} sent per rank per step" in text
    # Stage 3 gathers the parameters again for every accumulated micro-batch.
    assert run_facts(_run(2, "zero", grad_accum=2, zero_stage="3")).figures.collectives == 5
    # Stages 1, 2: a reduce-scatter and an all-gather send what DDP's all-reduce sends.
    run = _run(3, "zero", zero_stage="1")
    fig, ddp = run_facts(run).figures, run_facts(_run(3)).figures
    assert fig.collectives == 2 and fig.sent_bytes == pytest.approx(ddp.sent_bytes)
    text = _text(run)
    assert "as many bytes as DDP's one all-reduce" in text and "0 / 0" not in text


def test_local_sgd_and_diloco_meet_every_h_steps():
    summary = {"steps": 50, "train_loss": 1.0, "meetings": 5, "meeting_bytes_sent": 12345}
    run = _run(2, "localsgd", summary, sync_every=10)
    fig = run_facts(run).figures
    assert fig.sync_every == 10
    assert fig.meeting_bytes == pytest.approx(FP32)  # a ring of the fp32 weights: 2(N-1)/N = 1
    assert fig.sent_bytes == pytest.approx(FP32 / 10) and fig.ddp_sent_bytes == FP32
    assert fig.params_bytes == 2 * FP32  # the replica and the weights of the last meeting
    text = _text(run)
    assert "training alone on its own shard for 10 steps (--sync-every 10)" in text
    assert f"at each meeting {nbytes(fig.meeting_bytes)} sent per rank" in text
    assert f"{nbytes(fig.sent_bytes)} per step on average" in text
    assert "12,345 bytes sent by rank 0 over 5 meetings" in text  # counted, from summary.json
    run = _run(3, "diloco", sync_every=50, outer_compress="int8")
    fig = run_facts(run).figures
    assert fig.meeting_bytes == P * 1 * (3 - 1)  # all-gather: 1 byte a parameter to N-1 ranks
    assert fig.optimizer_bytes == 8 * P + 2 * FP32  # AdamW + the outer anchor and momentum
    text = _text(run)
    assert "pseudo-gradient" in text and "all-gathered in int8 with one fp32 scale" in text
    assert f"at each meeting {nbytes(fig.meeting_bytes)} sent per rank" in text
    assert "--outer-lr 0.7, --outer-momentum 0.9" in text


@pytest.mark.parametrize("codec,meeting", [
    ("fp32", 2 * (3 - 1) / 3 * FP32), ("bf16", 2 * P * (3 - 1)), ("int8", P * (3 - 1))])
def test_diloco_meeting_bytes_by_codec(codec, meeting):
    fig = run_facts(_run(3, "diloco", sync_every=5, outer_compress=codec,
                         outer_momentum=0.0)).figures
    assert fig.meeting_bytes == pytest.approx(meeting)
    assert fig.sent_bytes == pytest.approx(meeting / 5)
    assert fig.optimizer_bytes == 8 * P + FP32  # no momentum: the anchor only


@pytest.mark.parametrize("name", sorted(registered()))
def test_every_registered_strategy_gives_figures_and_words(name):
    cls = registered()[name]
    work = Workload(world_size=2, params=P, step_batch=16, sample_numel=6 * 32,
                    n_layer=MODEL["n_layer"], block_size=6, vocab_size=10,
                    whole_params=whole_numel(GPT(GPTConfig(**MODEL))))
    fig = cls.Config().figures(work)
    assert fig is not None and fig.data_ranks >= 1 and fig.held_bytes > 0, name
    assert fig == run_facts(_run(2, name)).figures  # explain asks the strategy, nothing else
    assert name in WORDS, name
    text = _text(_run(2, name))
    assert "not estimated" not in text and "as the strategy plans" not in text, (name, text)
    assert nbytes(fig.held_bytes) in text, (name, text)
    if fig.sent_bytes is not None:
        assert nbytes(fig.sent_bytes) in text, (name, text)


def test_a_run_started_from_other_weights_says_so():
    assert "started from the weights of gpt2_dir (--init-from), not a random init" in _text(
        _run(2, init_from="gpt2_dir"))
    assert "--init-from" not in _text(_run(2))


def test_an_unknown_strategy_is_still_explained():
    run = _run(2, "someday")
    facts = run_facts(run)
    assert facts.cls is None and facts.figures is None and facts.data_ranks == 2
    text = _text(run)
    assert "--strategy someday: not known to this ringtrain" in text
    assert f"not estimated for --strategy someday; the model has {P:,} parameters" in text


def _text_run(root, data: str) -> None:
    (root / "config.json").write_text(json.dumps({
        "task": "text", "world_size": 2, "model": MODEL,
        "args": {"strategy": "ddp", "data": data, "block_size": 8, "snapshot_every": 100},
        "trainer": {"steps": 50, "batch_size": 16, "grad_accum": 1}}))


def test_a_text_runs_samples_come_from_the_directory_it_trained_on(tmp_path, monkeypatch):
    from ringtrain.data.prepare import prepare
    from ringtrain.data.tokens import load_tokens, prepare_text_in

    text = tmp_path / "input.txt"
    text.write_text("".join(f"line {i} of a small corpus\n" for i in range(300)))
    prepared = tmp_path / "tokens"
    prepare(str(text), str(prepared), progress=False)
    sets = load_tokens(str(prepared), 8)
    want = (len(sets.train_set), len(sets.eval_set))
    # --data a prepared directory (given relative to where the run started, then from elsewhere)
    monkeypatch.chdir(tmp_path)
    (run := tmp_path / "run").mkdir()
    _text_run(run, "tokens")
    assert (load_run(run).train_samples, load_run(run).eval_samples) == want
    monkeypatch.chdir(run)
    got = load_run(run)
    assert (got.train_samples, got.eval_samples) == (None, None)
    assert "not found from here (a relative --data is read from where the run started" in (
        _text(got))
    # --data a text file: the run trained on its char-level copy in RUN_DIR/data
    (other := tmp_path / "run2").mkdir()
    _text_run(other, str(text))
    copy = load_tokens(prepare_text_in(str(text), str(other)), 8)
    got = load_run(other)
    assert (got.train_samples, got.eval_samples) == (len(copy.train_set), len(copy.eval_set))
    assert f"{got.train_samples:,} training samples, {got.eval_samples:,} held out" in _text(got)


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


def test_the_command_lists_explain(capsys):
    from ringtrain.cli import main as ringtrain_main  # what `python -m ringtrain` runs

    assert ringtrain_main(["--help"]) == 0  # in-process: an interpreter start prints the same
    assert "explain" in capsys.readouterr().out


def test_an_export_is_named_as_one_not_as_a_run_without_config(tmp_path, capsys):
    """`ringtrain explain gpt2_dir` said 'config.json is not the config.json of ringtrain
    train'; an export holds one model and no run: the message says what it is and what reads
    it. A finished run without snapshots (--snapshot-every 0) is still read as a run."""
    from ringtrain.formats.dcp import export_dcp
    from ringtrain.formats.hf_gpt2 import export_hf

    model = GPT(GPTConfig(vocab_size=10, block_size=6, n_layer=1, n_head=2, n_embd=8))
    for fmt, write, kind in (("hf", export_hf, "an hf export"), ("dcp", export_dcp,
                                                                 "a dcp export")):
        write(model, str(tmp_path / fmt))
        assert main([str(tmp_path / fmt)]) == 2
        assert capsys.readouterr().err == (
            f"ringtrain explain: error: {tmp_path / fmt} is {kind}, not a run directory; "
            f"`ringtrain sample {tmp_path / fmt}` generates with it; pass the --run-dir of the "
            "run it came from to explain that run\n")
    from ringtrain.models.export import export_model

    finished = tmp_path / "finished"  # its final model beside its config.json, no snapshots
    finished.mkdir()
    _text_run(finished, str(tmp_path / "data"))
    export_model(model, str(finished))
    assert load_run(finished).config["world_size"] == 2
    from ringtrain.data.prepare import prepare

    (tmp_path / "t.txt").write_text("some text to prepare\n" * 20)
    prepare(str(tmp_path / "t.txt"), str(tmp_path / "dataset"), progress=False)
    assert main([str(tmp_path / "dataset")]) == 2
    assert "is a prepared dataset, not a run directory (ringtrain train --data " in (
        capsys.readouterr().err)


def test_a_reader_that_stops_early_ends_the_command_quietly(monkeypatch):
    """`ringtrain plan ... | head -1`: a BrokenPipeError traceback at the first print after
    head exited; now the exit a shell gives a tool the pipe ended (128 + SIGPIPE), quietly."""
    import os
    import signal

    from ringtrain.cli import main as ringtrain_main

    read, write = os.pipe()
    os.close(read)  # the reader is gone
    with open(write, "w", buffering=1) as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert ringtrain_main(["plan", "--nproc-per-node", "2"]) == 128 + signal.SIGPIPE
        print("more", file=out)  # stdout is /dev/null now: nothing raises at the exit


def test_an_early_stopped_run_is_explained_and_run_again_trains_nothing(tmp_path, capsys,
                                                                       clean_env):
    """--stop-at-accuracy: the stop step's snapshot is the one a resume uses, and explain says
    the run stopped there; the same command again trains nothing and moves nothing aside."""
    from ringtrain.cli import main as ringtrain_main

    run = tmp_path / "run"
    argv = ["train", "--steps", "40", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
            "--eval-every", "10", "--no-progress", "--no-report", "--threads", "1",
            "--stop-at-accuracy", "0.001", "--run-dir", str(run)]  # met at the first eval
    assert ringtrain_main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and (run / "snapshots" / "snap-00000010").is_dir()
    capsys.readouterr()
    assert main([str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("step 10 of 40 (where the run stopped early: the same command trains nothing, a "
            "higher --stop-at-accuracy goes on from it)") in out
    assert ringtrain_main(argv) == 0
    said = capsys.readouterr()
    assert "the run stopped early at step 10 (eval_loss" in said.out + said.err
    assert not (run / "set-aside").exists()
    assert json.loads((run / "summary.json").read_text())["param_sha256"] == \
        summary["param_sha256"]
