"""`--pad-vocab N`: a vocabulary tensor parallelism can split. A character text has as many tokens
as it has characters (29 here, tiny Shakespeare's 65), and `--tp 2` splits the embedding's and
lm_head's rows: the run was refused, the message said "pad the vocabulary", and no flag did.

    .venv/bin/pytest -q tests/test_pad_vocab.py

The padded rows are no token: sampling never draws one, an export keeps the model's rows and
records the tokenizer's tokens, and a snapshot moves between strategies with the same
--pad-vocab. The tp 2 run (2 processes through the launcher) equals one process's (ddp) loss for
loss; the rest runs in-process on one rank. CPU and gloo (the suite's RINGTRAIN_DEVICE=cpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ringtrain.cli import main as ringtrain_main
from ringtrain.cli.options import ModelOptions
from ringtrain.cli.train import main as train_main
from ringtrain.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace
TINY = ["--n-layer", "1", "--n-embd", "32", "--batch-size", "8", "--block-size", "16",
        "--eval-every", "4", "--no-progress", "--threads", "1", "--no-report",
        "--sample-length", "60"]
WORDS = "the quick brown fox jumps over a lazy dog".split()  # 26 letters + ' ', '.', '\n'


def _text(path) -> str:
    rng = np.random.default_rng(0)
    path.write_text("".join(" ".join(rng.choice(WORDS, 6)) + ".\n" for _ in range(300)))
    return str(path)


def test_unit_rows_of_a_padded_vocabulary():
    assert [ModelOptions(pad_vocab=p).vocab_rows(29) for p in (1, 2, 3, 64)] == [29, 30, 30, 64]
    assert ModelOptions(pad_vocab=64).vocab_rows(50257) == 50304  # nanoGPT's GPT-2


def test_unit_generate_never_draws_a_padded_row():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # the final features all 1: the two padded rows win every draw
        model.head.ln_f.weight.zero_()
        model.head.ln_f.bias.fill_(1.0)
        model.head.lm_head.weight[10:] = 1.0
    x = torch.zeros(1, 1, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    assert model.generate(x, 6, temperature=0)[0, 1:].min() >= 10  # the test bites
    for kw in ({"temperature": 0}, {"temperature": 1.5}, {"temperature": 1.0, "top_k": 3}):
        out = model.generate(x, 20, generator=g, vocab=10, **kw)
        assert out.max() < 10, kw


def test_tp_on_an_odd_vocabulary_equals_one_process_and_samples_and_exports(tmp_path, capsys):
    data = _text(tmp_path / "t.txt")
    common = [*TINY, "--data", data, "--steps", "8", "--pad-vocab", "2"]
    # Refused before any worker starts, with the flag to add.
    assert train_main([*TINY, "--data", data, "--strategy", "tp", "--tp", "2",
                       "--nproc-per-node", "2", "--run-dir", str(tmp_path / "no")]) == 2
    assert ("--tp 2 splits the vocabulary's rows over the tp ranks, and the model has 29 (the "
            "data's tokens), not a multiple of 2: add --pad-vocab 2") in capsys.readouterr().err
    tp = subprocess.run([sys.executable, "-m", "ringtrain", "train", *common, "--strategy", "tp",
                         "--tp", "2", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "tp")],
                        capture_output=True, text=True, timeout=180, cwd=tmp_path,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert tp.returncode == 0, tp.stdout[-2000:] + tp.stderr[-3000:]
    assert train_main([*common, "--run-dir", str(tmp_path / "one")]) == 0

    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert len(losses("tp")) == 8
    np.testing.assert_allclose(losses("tp"), losses("one"), rtol=1e-5)
    model = json.loads((tmp_path / "tp" / "model_config.json").read_text())
    assert model["model"]["vocab_size"] == 30 and len(model["tokenizer"]["chars"]) == 29
    # The run's sample decoded (a padded id has no character: decode would raise).
    assert len(json.loads((tmp_path / "tp" / "summary.json").read_text())["sample"]) == 61
    capsys.readouterr()
    assert ringtrain_main(["export", str(tmp_path / "tp"), str(tmp_path / "hf"), "--format",
                           "hf"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 30
    capsys.readouterr()
    texts = []
    for source in ("tp", "hf"):  # hot enough that the padded rows would be drawn if allowed
        assert ringtrain_main(["sample", str(tmp_path / source), "--tokens", "300",
                               "--temperature", "5", "--top-k", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 300
    assert ringtrain_main(["explain", str(tmp_path / "tp")]) == 0
    assert "vocabulary padded to 30 rows (--pad-vocab 2" in capsys.readouterr().out


def test_another_padding_is_named_on_resume_and_init_from(tmp_path, capsys):
    data = _text(tmp_path / "t.txt")
    run = str(tmp_path / "run")
    base = [*TINY, "--data", data, "--snapshot-every", "2", "--run-dir", run]
    assert train_main([*base, "--steps", "4", "--pad-vocab", "2"]) == 0
    capsys.readouterr()
    assert train_main([*base, "--steps", "6"]) == 2
    assert "--pad-vocab 2 in the snapshot, (the default) now" in capsys.readouterr().err
    assert train_main([*base, "--steps", "6", "--pad-vocab", "2"]) == 0


def test_init_from_a_model_padded_otherwise_takes_the_tokens_rows(tmp_path):
    """Another --pad-vocab is not another model: GPT-2's 50257 rows start a run padded to
    50258 for --tp 2 (or nanoGPT's 50304 one of 50257). The tokens' rows are copied, the
    padding rows keep their initialisation, and every token's logit is the source's."""
    from ringtrain.formats.init_from import load_into
    from ringtrain.models.export import load_model

    data = _text(tmp_path / "t.txt")
    run = str(tmp_path / "run")
    assert train_main([*TINY, "--data", data, "--steps", "2", "--pad-vocab", "2",
                       "--run-dir", run]) == 0
    source, _ = load_model(run)  # 30 rows
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    for rows in (29, 32):
        config = GPTConfig(**{**source.config.__dict__, "vocab_size": rows})
        model = load_into(GPT(config), run, tokens=29)
        assert model.embed.wte.weight.shape[0] == rows
        torch.testing.assert_close(model(x)[..., :29], source(x)[..., :29], rtol=0, atol=0)
        with pytest.raises(ValueError, match="vocab_size=30"):  # without the tokens: refused
            load_into(GPT(config), run)
    for pad in ("1", "8"):  # and through the command line, training on
        assert train_main([*TINY, "--data", data, "--steps", "2", "--init-from", run,
                           "--pad-vocab", pad, "--run-dir", str(tmp_path / pad)]) == 0

