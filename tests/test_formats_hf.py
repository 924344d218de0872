"""ringtrain's GPT <-> Hugging Face transformers' GPT2LMHeadModel (CPU, fp32), with models that
transformers builds from a config here (nothing is downloaded): equal logits both ways, and
ringtrain -> transformers -> ringtrain gives the same param_sha256, also from a finished run
through `ringtrain export` and `ringtrain train --init-from`."""

import json

import pytest
import torch

from ringtrain.formats.hf_gpt2 import export_hf, load_hf
from ringtrain.models import GPT, GPTConfig
from ringtrain.training.config import param_sha256

transformers = pytest.importorskip(
    "transformers", reason="transformers is the optional extra `hf`: pip install -e '.[hf]'")
pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace
VARIANTS = [{}, {"bias": False}, {"tie_embeddings": True},
            {"bias": False, "tie_embeddings": True}]


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(kw) or "default")
def test_transformers_loads_the_export_with_equal_logits(tmp_path, kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=12, n_layer=2, n_head=4, n_embd=32, **kw))
    export_hf(model, str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    x = torch.randint(0, 13, (3, 12))
    torch.testing.assert_close(_logits(hf, x), _logits(model, x), rtol=0, atol=1e-5)
    # ... and transformers' own save_pretrained of it comes back as the very same weights
    hf.save_pretrained(str(tmp_path / "resaved"))
    back = load_hf(str(tmp_path / "resaved"))
    assert back.config == model.config
    assert param_sha256(back.state_dict()) == param_sha256(model.state_dict())


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_transformers_built_loads_with_equal_logits(tmp_path, tie):
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=17, n_positions=10, n_embd=24, n_layer=3,
                                     n_head=3, activation_function="gelu",
                                     tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # GPT-2 initialises biases to zero: give them values to carry
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.02)
    hf.save_pretrained(str(tmp_path))
    model = load_hf(str(tmp_path))
    assert (model.config.n_layer, model.config.tie_embeddings, model.config.bias) == (3, tie, True)
    x = torch.randint(0, 17, (2, 10))
    torch.testing.assert_close(_logits(model, x), _logits(hf, x), rtol=0, atol=1e-5)


def test_run_export_transformers_init_from_round_trip(tmp_path):
    """A run's final model -> `ringtrain export --format hf` -> transformers (loaded, saved
    again) -> `ringtrain train --init-from`: the new run's model starts as the first run ended."""
    from ringtrain.cli import main as ringtrain_main
    from ringtrain.cli.job import build_job
    from ringtrain.cli.train import main as train_main
    from ringtrain.cli.train_args import parse_options

    tiny = ["--steps", "4", "--n-layer", "1", "--n-embd", "32", "--batch-size", "8",
            "--no-progress", "--threads", "1", "--snapshot-every", "0"]
    assert train_main([*tiny, "--run-dir", str(tmp_path / "run")]) == 0
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["param_sha256"]
    assert ringtrain_main(["export", str(tmp_path / "run"), str(tmp_path / "hf"),
                           "--format", "hf"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    hf.save_pretrained(str(tmp_path / "hf2"))
    model = build_job(parse_options([*tiny, "--init-from", str(tmp_path / "hf2")]))["model_fn"]()
    assert param_sha256(model.state_dict()) == final
