"""The GPT model (`ringtrain.models.gpt`): shapes, causality, stages, tying, errors."""

import ast
import inspect

import pytest
import torch

from ringtrain.models import GPT, GPTConfig, gpt, loss_fn


def small(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, **kw))


def test_logits_shape():
    model = small()
    idx = torch.randint(0, 11, (3, 8))
    assert model(idx).shape == (3, 8, 11)
    assert model(idx[:, :5]).shape == (3, 5, 11)


def test_causal_future_tokens_do_not_change_the_past():
    model = small().eval()
    idx = torch.randint(0, 11, (2, 8))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_to_sequential_equals_model_and_shares_parameters():
    model = small(dropout=0.1).eval()
    seq = model.to_sequential()
    assert len(seq) == model.config.n_layer + 2
    idx = torch.randint(0, 11, (2, 8))
    torch.testing.assert_close(seq(idx), model(idx), rtol=0, atol=0)
    seq_params = dict(seq.named_parameters())
    assert len(seq_params) == len(dict(model.named_parameters()))
    for name, p in seq_params.items():  # the documented name mapping recovers the same object
        assert model.get_parameter(model.sequential_name(name)) is p
    assert model.sequential_name("0.wte.weight") == "embed.wte.weight"
    assert model.sequential_name("2.ln_1.weight") == "blocks.1.ln_1.weight"
    assert model.sequential_name("3.lm_head.weight") == "head.lm_head.weight"
    with pytest.raises(ValueError, match="outside 0..3"):
        model.sequential_name("4.x")


def test_embeddings_untied_by_default_tied_on_request():
    assert small().head.lm_head.weight is not small().embed.wte.weight
    model = small(tie_embeddings=True)
    assert model.head.lm_head.weight is model.embed.wte.weight


def test_config_errors_say_the_fix():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig(vocab_size=10, block_size=8, n_head=4, n_embd=30)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=0)
    with pytest.raises(ValueError, match="block_size=8"):
        small()(torch.zeros(1, 9, dtype=torch.long))


def test_loss_ignores_minus_one_targets():
    logits = torch.randn(2, 4, 5)
    targets = torch.tensor([[-1, -1, 2, 3], [-1, -1, 0, 1]])
    expected = torch.nn.functional.cross_entropy(logits[:, 2:].reshape(-1, 5),
                                                 targets[:, 2:].reshape(-1))
    torch.testing.assert_close(loss_fn(logits, targets), expected)


def test_generate_greedy_appends_tokens():
    model = small().eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0)
    assert out.shape == (1, 7)


def test_model_imports_nothing_distributed():
    tree = ast.parse(inspect.getsource(gpt))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith("ringtrain") or "distributed" in m], names


@pytest.mark.parametrize("tie", [True, False])
def test_the_export_copies_only_a_tied_embedding_and_loads_back_equal(tmp_path, monkeypatch, tie):
    import safetensors.torch

    from ringtrain.models.export import export_model, load_model

    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8,
                          tie_embeddings=tie))
    saved = {}
    real_save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda state, *a, **k: (saved.update(state), real_save(state, *a, **k)))
    export_model(model, str(tmp_path))
    own = {k: v.data_ptr() for k, v in model.state_dict().items()}
    copied = sorted(k for k, v in saved.items() if v.data_ptr() != own[k])
    # The second name of the tied weight needs storage of its own; nothing else is copied.
    shared = [k for k, p in own.items() if list(own.values()).count(p) > 1]
    assert len(copied) == (1 if tie else 0) and set(copied) <= set(shared), (copied, shared)
    loaded, _ = load_model(str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
