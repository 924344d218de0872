"""ringtrain.formats on the CPU without transformers: torch distributed checkpoints (DCP) out and
back, loaded by `dcp.load` on 1 and 2 gloo ranks; `ringtrain export` and `--init-from` end to
end; the GPT-2 configs ringtrain's GPT cannot compute, refused with the reason. The transformers
side (logits equal, round trips through GPT2LMHeadModel) is tests/test_formats_hf.py."""

import json

import pytest
import torch

from ringtrain.cli import main as ringtrain_main
from ringtrain.cli.train import main as train_main
from ringtrain.data.addition import AdditionDataset
from ringtrain.formats.dcp import export_dcp, read_dcp
from ringtrain.formats.hf_gpt2 import FormatError, export_hf, gpt_config, hf_config, read_hf
from ringtrain.formats.init_from import detect, load_into
from ringtrain.models import GPT, GPTConfig
from ringtrain.models.export import load_model
from ringtrain.testing import run_workers
from ringtrain.training.config import param_sha256

pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace
TINY = ["--steps", "4", "--n-layer", "1", "--n-embd", "32", "--batch-size", "8",
        "--eval-every", "2", "--no-progress", "--threads", "1", "--snapshot-every", "2",
        "--no-report"]


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16, **kw))


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- DCP ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_dcp_export_reads_back_bit_exact(tmp_path, tie):
    model = _gpt(tie_embeddings=tie)
    export_dcp(model, str(tmp_path / "dcp"))
    assert detect(str(tmp_path / "dcp")) == "dcp"
    config, state = read_dcp(str(tmp_path / "dcp"))
    assert config == model.config
    back = load_into(GPT(config), str(tmp_path / "dcp"))
    assert param_sha256(back.state_dict()) == param_sha256(model.state_dict())


def _dcp_load_worker(rank, world_size, path, config):
    """One rank's torch.distributed.checkpoint.load into its own freshly initialised GPT (gloo,
    CPU): what a user of another stack does with the directory."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(100 + rank)  # other weights on every rank before the load
    model = GPT(GPTConfig(**config))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # the group is up: a collective load
    model.load_state_dict(state["model"])
    return param_sha256(model.state_dict())


@pytest.mark.parametrize("world_size", [1, 2])
def test_dcp_export_loads_with_dcp_load_on_any_world_size(tmp_path, world_size):
    model = _gpt()
    export_dcp(model, str(tmp_path / "dcp"))
    from dataclasses import asdict

    shas = run_workers(_dcp_load_worker, world_size,
                       (str(tmp_path / "dcp"), asdict(model.config)), timeout_s=120)
    assert shas == [param_sha256(model.state_dict())] * world_size


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, single process
def test_a_dcp_without_model_tensors_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"other": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(ValueError, match="without tensors under 'model.'"):
        read_dcp(str(tmp_path))


# -- GPT-2 configs ringtrain's GPT cannot compute ------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"activation_function": "gelu_new"}, "activation_function='gelu_new'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"n_inner": 32}, "n_inner=32"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"resid_pdrop": 0.1}, "one dropout"),
])
def test_gpt2_configs_that_would_compute_otherwise_are_refused(change, words):
    hf = {**hf_config(_gpt().config), **change}
    with pytest.raises(FormatError, match="without changing what it computes") as e:
        gpt_config(hf)
    assert words in str(e.value)


def test_the_original_gpt2_default_activation_is_refused():
    # a config.json without activation_function is GPT-2's gelu_new (GPT2Config's default)
    with pytest.raises(FormatError, match="gelu_new"):
        gpt_config({"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 8})


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"tie_embeddings": True}])
def test_gpt2_export_reads_back_bit_exact_without_transformers(tmp_path, kw):
    model = _gpt(**kw)
    export_hf(model, str(tmp_path))
    config, state = read_hf(str(tmp_path))
    assert config == model.config and _equal(state, model.state_dict())


def test_original_gpt2_names_load(tmp_path):
    """The original checkpoints name the body without 'transformer.' and keep attn.bias masks."""
    import safetensors.torch

    model = _gpt()
    export_hf(model, str(tmp_path))
    path = tmp_path / "model.safetensors"
    state = safetensors.torch.load_file(path)
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    old["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    safetensors.torch.save_file(old, path)
    assert _equal(read_hf(str(tmp_path))[1], model.state_dict())


# -- ringtrain export / --init-from end to end ---------------------------------------------------

@pytest.fixture
def run_dir(tmp_path):
    """A finished 4-step run (addition task, 1 process, snapshots of steps 2 and 4)."""
    run_dir = tmp_path / "run"
    assert train_main([*TINY, "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_export_then_init_from_each_format_starts_from_the_runs_weights(run_dir, tmp_path):
    final = json.loads((run_dir / "summary.json").read_text())["param_sha256"]
    model, _ = load_model(str(run_dir))
    for fmt in ("hf", "dcp"):
        out = tmp_path / fmt
        assert ringtrain_main(["export", str(run_dir), str(out), "--format", fmt]) == 0
        assert detect(str(out)) == fmt
        back = load_into(GPT(model.config), str(out))
        assert param_sha256(back.state_dict()) == final, fmt
    # the snapshot of step 2, not the final model
    assert ringtrain_main(["export", str(run_dir), str(tmp_path / "s2"), "--format", "dcp",
                           "--snapshot", "2"]) == 0
    assert param_sha256(read_dcp(str(tmp_path / "s2"))[1]) != final
    # a run started from the export: its model_fn builds the exported weights
    from ringtrain.cli.job import build_job
    from ringtrain.cli.train_args import parse_options

    for fmt in ("hf", "dcp"):
        opts = parse_options([*TINY, "--init-from", str(tmp_path / fmt)])
        built = build_job(opts)["model_fn"]()
        assert param_sha256(built.state_dict()) == final, fmt
    # and trains from them: 4 more steps end somewhere else, from a loss already low
    assert train_main([*TINY, "--init-from", str(tmp_path / "hf"),
                       "--run-dir", str(tmp_path / "run2")]) == 0
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["param_sha256"] != final


def test_init_from_another_shape_says_the_flags(run_dir, tmp_path, capsys):
    assert ringtrain_main(["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"]) == 0
    rc = train_main([*TINY, "--n-layer", "2", "--init-from", str(tmp_path / "hf"),
                     "--run-dir", str(tmp_path / "run2")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--n-layer 1" in err and "--n-layer 2" in err and "drop --init-from" in err


def test_init_from_gives_the_run_its_models_shape_where_no_option_sets_it(tmp_path):
    """A GPT-2 directory of another shape than the defaults: a run without shape options
    takes its layers, heads, width, biases and tied embeddings (from_pretrained's way), not
    its dropout; a shape option set otherwise is refused, naming the flags."""
    from ringtrain.cli.job import build_job
    from ringtrain.cli.train_args import parse_options
    from ringtrain.models.export import export_model

    task = AdditionDataset("train", 2)  # the default task's vocabulary and positions
    model = GPT(GPTConfig(vocab_size=task.vocab_size, block_size=task.block_size, n_layer=3,
                          n_head=2, n_embd=24,
                          bias=False, tie_embeddings=True, dropout=0.3))
    export_model(model, str(tmp_path / "run"), tokenizer=None)
    for fmt in ("hf", "dcp"):
        assert ringtrain_main(["export", str(tmp_path / "run"), str(tmp_path / fmt),
                               "--format", fmt]) == 0
        opts = parse_options(["--init-from", str(tmp_path / fmt), "--no-progress"])
        m = opts.model
        assert (m.n_layer, m.n_head, m.n_embd, m.bias, m.tie_embeddings, m.dropout) == (
            3, 2, 24, False, True, 0.0), fmt
        built = build_job(opts)["model_fn"]()
        assert param_sha256(built.state_dict()) == param_sha256(model.state_dict()), fmt
    with pytest.raises(ValueError, match=r"--n-layer 3 .* --n-layer 2; leave those out"):
        build_job(parse_options(["--init-from", str(tmp_path / "hf"), "--n-layer", "2"]))


def test_init_from_a_directory_of_nothing_known_is_refused(tmp_path, capsys):
    rc = train_main([*TINY, "--init-from", str(tmp_path), "--run-dir", str(tmp_path / "r")])
    assert rc == 2 and "neither a torch distributed checkpoint" in capsys.readouterr().err


def test_init_from_a_larger_block_keeps_the_first_positions(tmp_path):
    vocab, block = AdditionDataset("train", 2).vocab_size, AdditionDataset("train", 2).block_size
    big = GPT(GPTConfig(vocab_size=vocab, block_size=block + 5, n_layer=1, n_embd=32))
    export_dcp(big, str(tmp_path))
    model = load_into(GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=1, n_embd=32)),
                      str(tmp_path))
    assert torch.equal(model.embed.wpe.weight, big.embed.wpe.weight[:block])
    x = torch.randint(0, vocab, (2, block))
    torch.testing.assert_close(model(x), big(x), rtol=0, atol=0)


def test_export_of_a_missing_run_is_one_message(tmp_path, capsys):
    assert ringtrain_main(["export", str(tmp_path), str(tmp_path / "o"), "--format", "hf"]) == 2
    assert "no config.json" in capsys.readouterr().err
    missing = tmp_path / "typo"
    assert ringtrain_main(["export", str(missing), str(tmp_path / "o"), "--format", "hf"]) == 2
    assert f"{missing}: no such directory" in capsys.readouterr().err
    assert ringtrain_main(["sample", str(missing)]) == 2
    assert f"{missing}: no such directory" in capsys.readouterr().err


def test_export_replaces_an_export_of_its_format_only(run_dir, tmp_path, capsys):
    """dcp's .metadata left beside a new hf export made --init-from and sample read the old
    dcp model, silently; an OUT_DIR of other files is not ours to write over."""
    out, mine = tmp_path / "out", tmp_path / "mine"
    for fmt, said in (("dcp", "wrote dcp to"), ("dcp", "(replacing the dcp export there)")):
        assert ringtrain_main(["export", str(run_dir), str(out), "--format", fmt]) == 0
        assert said in capsys.readouterr().out
    before = sorted(p.name for p in out.iterdir())
    assert ringtrain_main(["export", str(run_dir), str(out), "--format", "hf"]) == 2
    assert capsys.readouterr().err == (
        f"ringtrain export: OUT_DIR {out} is not empty (.metadata, __0_0.distcp, "
        "model_config.json: a dcp export: one directory of two models is read as one or the "
        "other by reader (--init-from and sample take the dcp one, transformers the hf one)); "
        "give a new or empty directory, or an earlier --format hf export's, which is replaced\n")
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert ringtrain_main(["export", str(run_dir), str(mine), "--format", "hf"]) == 2
    assert "(notes.txt: not an earlier ringtrain export of this format)" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
