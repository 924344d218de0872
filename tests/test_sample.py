"""`ringtrain sample` and the exported model (model.safetensors + model_config.json), on a BPE
run with the recipe's flags (--beta2, --no-bias, --tie-embeddings), and docs/train.md's lines."""

import contextlib
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.train_ranks import train_ranks

from ringtrain.cli import main as ringtrain_main
from ringtrain.data.prepare import prepare
from ringtrain.launch.process_group import destroy_distributed
from ringtrain.models.export import load_model

pytest.importorskip("tokenizers", reason="the run here is BPE: pip install -e '.[dev]'")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "train.md"
TEXT = "".join(f"the king {i % 5} shall speak of love and war, my lord {i % 11}.\n"
               for i in range(200))


@contextlib.contextmanager
def _in_process():
    """A `ringtrain train` in this process leaves no trace: env, logging, threads, group."""
    logger = logging.getLogger("ringtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate, torch.get_num_threads())
    with pytest.MonkeyPatch.context() as mp:
        for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                  "TORCHELASTIC_RUN_ID"):
            mp.delenv(v, raising=False)
        try:
            yield
        finally:
            destroy_distributed()
            logger.handlers[:], logger.level, logger.propagate = saved[:3]
            torch.set_num_threads(saved[3])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 6-step run in <tmp>/runs/shakespeare, with snapshots of steps 3 and 6."""
    root = tmp_path_factory.mktemp("sample")
    (root / "t.txt").write_text(TEXT)
    prepare(str(root / "t.txt"), str(root / "data"), tokenizer="bpe", vocab_size=280,
            progress=False)
    run_dir = root / "runs" / "shakespeare"
    with _in_process():
        assert ringtrain_main([
            "train", "--data", str(root / "data"), "--block-size", "16", "--steps", "6",
            "--snapshot-every", "3", "--n-layer", "1", "--n-embd", "32", "--batch-size", "4",
            "--beta2", "0.99", "--no-bias", "--tie-embeddings", "--threads", "1", "--no-progress",
            "--sample-length", "8", "--no-report", "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_config_json_records_the_recipe_flags(run):
    config = json.loads((run / "config.json").read_text())
    args = config["args"]
    assert (args["beta2"], args["bias"], args["tie_embeddings"]) == (0.99, False, True)
    assert (config["model"]["bias"], config["model"]["tie_embeddings"]) == (False, True)
    assert config["trainer"]["beta2"] == 0.99


def test_sample_the_final_model_and_a_snapshot(run, capsys):
    argv = ["sample", str(run), "--prompt", "the king", "--tokens", "12", "--seed", "1"]
    assert ringtrain_main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("the king") and len(first) > len("the king\n")
    assert ringtrain_main(argv) == 0 and capsys.readouterr().out == first  # seeded
    # Greedy decoding equals the exported model's own argmax continuation.
    assert ringtrain_main([*argv, "--temperature", "0"]) == 0
    model, config = load_model(str(run))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(run / config["tokenizer"]["file"]))
    out = model.generate(torch.tensor([tok.encode("the king").ids]), 12, temperature=0)
    assert capsys.readouterr().out == tok.decode(out[0].tolist()) + "\n"
    assert ringtrain_main([*argv, "--snapshot", "3"]) == 0
    assert capsys.readouterr().out.startswith("the king")
    assert ringtrain_main([*argv, "--snapshot", "4"]) == 2
    assert "no committed snapshot of step 4; committed: [3, 6]" in capsys.readouterr().err


def test_a_finished_run_going_on_is_read_as_in_progress_and_its_end_kept(run, tmp_path, capsys,
                                                                         monkeypatch):
    """`ringtrain train` again with more --steps: the end it had (summary, final model) moves
    to RUN_DIR/set-aside/end-6-<time>/ at the start, so sample, export and explain read the run
    as one in progress (its newest snapshot, named) and not as over at step 6 with its old
    model; a restarted worker, or the same --steps again, moves nothing."""
    import shutil
    from types import SimpleNamespace

    from ringtrain.cli.run_dir_setup import resume_or_clear, when_started
    from ringtrain.cli.train_args import parse_options

    run_dir = tmp_path / "extended"
    shutil.copytree(run, run_dir)
    rank0, log = SimpleNamespace(rank=0, world_size=1), logging.getLogger("test")
    config = json.loads((run_dir / "config.json").read_text())

    def started(steps: str) -> None:  # `ringtrain train` on a resume the trainer accepted
        opts = parse_options(["--run-dir", str(run_dir), "--steps", steps])
        assert resume_or_clear(opts, rank0, log)
        when_started(opts, rank0, config, log)(6, int(steps))  # from 6 to --steps

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    started("9")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    started("6")
    assert (run_dir / "summary.json").exists()  # neither a restart nor the same end moves it
    assert resume_or_clear(parse_options(["--run-dir", str(run_dir), "--steps", "9"]), rank0, log)
    assert (run_dir / "summary.json").exists()  # nor a resume the trainer may yet refuse
    started("9")
    [aside] = (run_dir / "set-aside").iterdir()
    assert aside.name.startswith("end-6-") and sorted(p.name for p in aside.iterdir()) == [
        "model.safetensors", "model_config.json", "summary.json"]  # --no-report: no report.png
    assert not (run_dir / "summary.json").exists() and (run_dir / "snapshots").is_dir()
    capsys.readouterr()
    assert ringtrain_main(["sample", str(run_dir), "--tokens", "4"]) == 0
    said = (f"{run_dir} has not finished (no final model yet): the model of its newest committed "
            "snapshot, step 6 (--snapshot STEP for another)")
    assert capsys.readouterr().err == f"ringtrain sample: {said}\n"
    assert ringtrain_main(["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert capsys.readouterr().out.startswith(f"ringtrain export: {said}\nwrote hf to ")
    assert ringtrain_main(["explain", str(run_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "did not finish (no summary.json)" in out
    assert (f"set aside by going on past the end at step 6: {aside} (that end's model.safetensors,"
            " model_config.json, summary.json)") in out
    from ringtrain.formats.init_from import FormatError, detect

    with pytest.raises(FormatError, match=rf"a run that has not finished .* ringtrain export "
                                          rf"{run_dir} OUT_DIR --format dcp, then --init-from"):
        detect(str(run_dir))  # --init-from: not its old end's model, silently


@pytest.mark.parametrize("every, why", [
    (3, "{run_dir}/snapshots holds none"),  # deleted
    (0, "it ran with --snapshot-every 0"),
    (100, "its 6 steps took none at --snapshot-every 100")])  # before the last step's snapshot
def test_a_finished_run_with_no_snapshot_is_not_trained_again_over(run, tmp_path, every, why):
    """A finished run with no snapshot to go on from: resuming would train from step 0 and
    replace its metrics, model and summary; refused (same or more --steps), nothing moved;
    --no-resume sets it aside and starts afresh."""
    import shutil
    from types import SimpleNamespace

    from ringtrain.cli.run_dir_setup import resume_or_clear
    from ringtrain.cli.train_args import parse_options
    from ringtrain.errors import ConfigError

    run_dir = tmp_path / "no-snapshot"
    shutil.copytree(run, run_dir)
    shutil.rmtree(run_dir / "snapshots")
    config = json.loads((run_dir / "config.json").read_text())
    config["args"]["snapshot_every"] = every
    (run_dir / "config.json").write_text(json.dumps(config))
    rank0, log = SimpleNamespace(rank=0, world_size=1), logging.getLogger("test")
    said = (f"--run-dir {run_dir} holds a finished run of 6 steps and no snapshot to go on from "
            f"({why.format(run_dir=run_dir)}): training now would start at step 0 and replace "
            f"its results. --no-resume sets that run aside in {run_dir}/set-aside/ and trains "
            f"afresh; or give another --run-dir (--init-from {run_dir} starts a new run from its "
            "final model)")
    for steps in ("6", "9"):
        with pytest.raises(ConfigError) as e:
            resume_or_clear(parse_options(["--run-dir", str(run_dir), "--steps", steps]), rank0,
                            log)
        assert str(e.value) == said
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        p.name for p in run.iterdir() if p.name != "snapshots")  # nothing moved
    assert not resume_or_clear(parse_options(["--run-dir", str(run_dir), "--no-resume"]), rank0,
                               log)
    assert not (run_dir / "summary.json").exists()


def test_init_from_other_weights_than_the_run_to_resume_started_from_is_refused(run, tmp_path):
    """--init-from X on a run directory with snapshots: a resume goes on with the snapshot's
    weights, so X's were silently not read; refused, naming what the run started from. The
    run's own --init-from again (the same command: a resubmitted job) resumes."""
    import shutil
    from types import SimpleNamespace

    from ringtrain.cli.run_dir_setup import resume_or_clear
    from ringtrain.cli.train_args import parse_options
    from ringtrain.errors import ConfigError

    run_dir, other = tmp_path / "resumable", str(tmp_path / "gpt2_dir")
    shutil.copytree(run, run_dir)
    rank0, log = SimpleNamespace(rank=0, world_size=1), logging.getLogger("test")
    with pytest.raises(ConfigError) as e:
        resume_or_clear(parse_options(["--run-dir", str(run_dir), "--init-from", other]), rank0,
                        log)
    assert str(e.value) == (
        f"--init-from {other}: --run-dir {run_dir} holds a run to resume, which started from "
        "random weights, and a resume goes on with its snapshot's weights, not these. "
        f"--no-resume starts afresh from {other} (the earlier run is set aside in "
        f"{run_dir}/set-aside/); or give another --run-dir; or drop --init-from to resume")
    config = json.loads((run_dir / "config.json").read_text())
    config["args"]["init_from"] = other
    (run_dir / "config.json").write_text(json.dumps(config))
    assert resume_or_clear(parse_options(["--run-dir", str(run_dir), "--init-from", other]),
                           rank0, log)
    assert (run_dir / "summary.json").exists()


def test_a_snapshot_is_not_decoded_with_data_prepared_again_since(run, tmp_path, capsys):
    """A run not finished is read with its data's tokenizer: a --data DIR prepared again from
    other text since is named (sample decoded the snapshot's ids as other text, and export
    wrote that tokenizer beside the model), not used."""
    import shutil

    run_dir, data = tmp_path / "unfinished", tmp_path / "data"
    shutil.copytree(run, run_dir)
    shutil.copytree(run.parent.parent / "data", data)
    for name in ("model.safetensors", "model_config.json", "summary.json"):
        (run_dir / name).unlink()
    config = json.loads((run_dir / "config.json").read_text())
    config["args"]["data"] = str(data)
    (run_dir / "config.json").write_text(json.dumps(config))
    assert ringtrain_main(["sample", str(run_dir), "--tokens", "2"]) == 0  # the same data
    (tmp_path / "other.txt").write_text(TEXT.replace("king", "queen") * 2)
    prepare(str(tmp_path / "other.txt"), str(data), tokenizer="bpe", vocab_size=270,
            progress=False)
    capsys.readouterr()
    assert ringtrain_main(["sample", str(run_dir), "--tokens", "2"]) == 2
    said = (f"the snapshot of step 6 of {run_dir} was trained on data tokenized as bpe, ")
    assert said in capsys.readouterr().err
    assert ringtrain_main(["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_refused_resume_leaves_the_runs_config(run, tmp_path, capsys):
    """config.json and the run's end stay until a resume is accepted: a command with another
    option (or fewer --steps) is refused, and explain, `sample --snapshot` and the next resume
    still read the run's own (they read the refused command's, and sample --snapshot failed to
    load; one going past the end had set the final model aside)."""
    import shutil

    run_dir = tmp_path / "refused"
    shutil.copytree(run, run_dir)
    before = (run_dir / "config.json").read_bytes()
    base = ["train", "--data", str(run.parent.parent / "data"), "--block-size", "16",
            "--n-embd", "32", "--batch-size", "4", "--beta2", "0.99", "--no-bias",
            "--tie-embeddings", "--threads", "1", "--no-progress", "--sample-length", "8",
            "--no-report", "--snapshot-every", "3", "--run-dir", str(run_dir)]
    for changed in (["--n-layer", "2", "--steps", "6"], ["--n-layer", "1", "--steps", "4"],
                    ["--n-layer", "2", "--steps", "9"]):  # the last would go past the end
        with _in_process():
            assert ringtrain_main([*base, *changed]) == 2
        assert (run_dir / "config.json").read_bytes() == before
        assert (run_dir / "summary.json").exists() and not (run_dir / "set-aside").exists()
    assert "--n-layer 1 in the snapshot, 2 now" in capsys.readouterr().err
    assert ringtrain_main(["sample", str(run_dir), "--snapshot", "3", "--tokens", "2"]) == 0
    with _in_process():  # the same options and more steps: accepted, and written
        assert ringtrain_main([*base, "--n-layer", "1", "--steps", "7"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["args"]["steps"] == 7


def test_docs_lines_load_the_export_literally(run, monkeypatch):
    """docs/train.md's two blocks as written, from the run's parent directory: the first in a
    process where ringtrain cannot be imported, then both here."""
    docs = DOCS.read_text()
    blocks = [re.search(rf"<!-- {name} -->\n```python\n(.*?)```", docs, re.S).group(1)
              for name in ("load-without-ringtrain", "load-into-gpt")]
    no_ringtrain = "import sys\nsys.modules['ringtrain'] = None\n" + blocks[0]
    proc = subprocess.run([sys.executable, "-c", no_ringtrain], cwd=run.parent.parent,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["1", "bpe"]
    monkeypatch.chdir(run.parent.parent)
    scope: dict = {}
    exec(blocks[0] + blocks[1], scope)
    reference, _ = load_model(str(run))
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(scope["model"](x), reference(x))


@pytest.fixture
def clean_env():
    with _in_process():
        yield


def test_a_zero_snapshot_is_put_together_and_the_addition_task_samples_digits(tmp_path, capsys,
                                                                               clean_env):
    """zero-3 on 1 rank, tied embeddings: the snapshot of the last step equals the export."""
    run_dir = str(tmp_path / "zero")
    assert ringtrain_main(["train", "--strategy", "zero", "--zero-stage", "3", "--tie-embeddings",
                           "--steps", "2", "--snapshot-every", "2", "--n-layer", "1",
                           "--n-embd", "16", "--threads", "1", "--no-progress",
                           "--run-dir", run_dir]) == 0
    capsys.readouterr()
    # The addition task answers sums (greedily): held-out ones, or the one in --prompt.
    assert ringtrain_main(["sample", run_dir, "--snapshot", "2"]) == 0
    from_snapshot = capsys.readouterr().out
    assert re.fullmatch(r"(\d+\+\d+=\d+ (ok|\(wrong: \d+\))\n){5}", from_snapshot)
    assert ringtrain_main(["sample", run_dir]) == 0 and capsys.readouterr().out == from_snapshot
    for prompt in ("12+34", "1234", "12+34=", " 12 + 34 "):  # as typed, or copied from a sample
        assert ringtrain_main(["sample", run_dir, "--prompt", prompt]) == 0
        assert re.fullmatch(r"12\+34=\d+ (ok|\(wrong: 46\))\n", capsys.readouterr().out)
    from ringtrain.cli.sample import snapshot_model

    snap_dir = tmp_path / "zero" / "snapshots" / "snap-00000002"
    manifest = json.loads((snap_dir / "manifest.json").read_text())
    assert manifest["metadata"]["replicated"] is False  # per-rank shards, put together here
    config = json.loads((tmp_path / "zero" / "config.json").read_text())
    snap, (final, _) = snapshot_model(run_dir, 2, config["model"]), load_model(run_dir)
    for (name, a), (_, b) in zip(snap.state_dict().items(), final.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert ringtrain_main(["sample", run_dir, "--prompt", "123+4"]) == 2
    assert ("--prompt '123+4': this run adds numbers of up to 2 digits; give a sum, e.g. "
            "--prompt 12+34") in capsys.readouterr().err
    for flags, said in ((["--tokens", "0"], "--tokens 0: it must be 1 or more"),
                        (["--temperature", "-1", "--top-k", "-2"], "--temperature -1.0: it must "
                         "be 0 or more (0: the likeliest token each time); --top-k -2: it must "
                         "be 0 or more (0: every token)")):  # each value named, not all rules
        assert ringtrain_main(["sample", run_dir, *flags]) == 2
        assert capsys.readouterr().err == f"ringtrain sample: error: {said}\n"


@pytest.mark.parametrize("layout", [["--strategy", "pipeline", "--pp", "2"],
                                    ["--strategy", "tp", "--tp", "2"]], ids=["pipeline", "tp"])
def test_a_snapshot_of_per_rank_parts_is_put_together_by_its_strategy(tmp_path, layout):
    """2 ranks; each rank holds part of the model. The snapshot of the last step, joined by the
    strategy's own converter (`to_portable`), equals the exported final model bit for bit."""
    from ringtrain.cli.sample import snapshot_model

    run_dir = str(tmp_path / "run")
    train_ranks([*layout, "--steps", "4", "--snapshot-every", "4", "--n-layer", "2",
                 "--n-embd", "16", "--no-progress", "--no-report", "--run-dir", run_dir], 2)
    manifest = json.loads((tmp_path / "run" / "snapshots" / "snap-00000004" /
                           "manifest.json").read_text())
    assert manifest["metadata"]["replicated"] is False
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    snap, (final, _) = snapshot_model(run_dir, 4, config["model"]), load_model(run_dir)
    for (name, a), (_, b) in zip(snap.state_dict().items(), final.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("content,said", [
    ("{bad", "config.json: cannot read it (Expecting property name"),
    ("[1, 2]", "config.json is not the config.json of a `ringtrain train` run (it needs args and "
               "model)"),
])
def test_a_broken_config_json_is_one_line_in_sample_and_export(tmp_path, capsys, content, said):
    from ringtrain.cli import main as ringtrain_main

    (tmp_path / "config.json").write_text(content)
    for argv in (["sample", str(tmp_path)], ["export", str(tmp_path), str(tmp_path / "o"),
                                             "--format", "hf"]):
        assert ringtrain_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def test_a_text_without_newlines_samples_without_a_prompt(tmp_path, capsys):
    """The default prompt is a newline; a character vocabulary without one (a text on one line)
    starts from its first character instead of refusing a --prompt the user never gave."""
    text = tmp_path / "line.txt"
    text.write_text("abc cab bca " * 200)
    run_dir = tmp_path / "run"
    with _in_process():
        assert ringtrain_main(["train", "--data", str(text), "--block-size", "8", "--steps", "2",
                               "--n-layer", "1", "--n-embd", "16", "--batch-size", "4",
                               "--no-progress", "--no-report", "--snapshot-every", "0",
                               "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert ringtrain_main(["sample", str(run_dir), "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" ") and len(out.rstrip("\n")) == 6 and set(out) <= set(" abc\n"), out
