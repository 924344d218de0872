"""ringtrain's GPT <-> a Hugging Face transformers `GPT2LMHeadModel` directory.

    python -c "from ringtrain.formats.hf_gpt2 import export_hf; from ringtrain.models import \
GPT, GPTConfig; export_hf(GPT(GPTConfig(vocab_size=10, block_size=8)), 'gpt2_dir')"

The directory is what `GPT2LMHeadModel.save_pretrained` writes: `config.json` (model_type
gpt2) and `model.safetensors`. Neither direction needs `transformers` (json and safetensors
only); the tests load the export with it and compare logits. The two are one network, named
and laid out differently:

    ringtrain                        GPT-2 (transformers)
    embed.wte / embed.wpe            transformer.wte / transformer.wpe (learned positions)
    blocks.i.ln_1, ln_2              transformer.h.i.ln_1, ln_2 (LayerNorm, eps 1e-5 both)
    blocks.i.attn.c_attn  Linear     transformer.h.i.attn.c_attn  Conv1D, weight (in, out): the
    blocks.i.attn.c_proj  Linear     transformer.h.i.attn.c_proj  Linear's transposed; c_attn
    blocks.i.mlp.0 / mlp.2 Linear    transformer.h.i.mlp.c_fc / c_proj   is q, k, v in one, in
    head.ln_f, head.lm_head          transformer.ln_f, lm_head           the same order

What GPT-2 cannot say, or ringtrain's GPT cannot, is refused, never converted approximately.
ringtrain's MLP is exact GELU (`nn.GELU()`): GPT-2's `activation_function="gelu"`. The
original GPT-2 checkpoints use "gelu_new" (the tanh approximation), which ringtrain's GPT does
not have, so importing one is refused with the reason. A model without biases (`bias=False`)
is exported with zero biases (a zero bias is no bias: equal logits) and marked in config.json,
so that it comes back as `bias=False`; tied embeddings are GPT-2's `tie_word_embeddings`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import safetensors.torch
import torch

from ringtrain.models.gpt import GPT, GPTConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # a sharded save_pretrained: name -> shard file
MARK = "ringtrain"  # ringtrain's own entry in config.json (transformers keeps unknown keys)
EPS = 1e-5  # nn.LayerNorm's default: the eps of every LayerNorm of ringtrain's GPT
# ringtrain's name in a block -> (GPT-2's name, a Conv1D: its weight is the Linear's transposed),
# in the block's state_dict order (param_sha256 hashes in key order)
_BLOCK = {"ln_1": ("ln_1", False), "attn.c_attn": ("attn.c_attn", True),
          "attn.c_proj": ("attn.c_proj", True), "ln_2": ("ln_2", False),
          "mlp.0": ("mlp.c_fc", True), "mlp.2": ("mlp.c_proj", True)}
# GPT2Config's defaults, for a config.json that leaves a key out (transformers does the same)
_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": EPS, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False, "tie_word_embeddings": True}


class FormatError(ValueError):
    """A directory that is not the format it claims, or a model the target format cannot hold."""


# -- ringtrain -> GPT-2 ------------------------------------------------------------------------

def hf_config(config: GPTConfig) -> dict[str, Any]:
    """config.json of `GPT2LMHeadModel` for a GPT of `config`."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_inner": None, "activation_function": "gelu", "layer_norm_epsilon": EPS,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": config.tie_embeddings,
        # no bos/eos: ringtrain's vocabularies have none (GPT2Config's default, 50256, is
        # outside a small vocabulary and transformers warns)
        "bos_token_id": None, "eos_token_id": None,
        "dtype": "float32", MARK: {"bias": config.bias},
    }


def to_hf_state(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2's state dict (names and layouts) holding `model`'s weights, on the CPU."""
    cfg, state = model.config, model.state_dict()

    def bias_of(name: str, size: int) -> torch.Tensor:
        bias = state.get(f"{name}.bias")
        return bias if bias is not None else torch.zeros(size, dtype=state[f"{name}.weight"].dtype)

    out = {"transformer.wte.weight": state["embed.wte.weight"],
           "transformer.wpe.weight": state["embed.wpe.weight"],
           "transformer.ln_f.weight": state["head.ln_f.weight"],
           "transformer.ln_f.bias": bias_of("head.ln_f", cfg.n_embd)}
    for i in range(cfg.n_layer):
        for ours, (theirs, conv1d) in _BLOCK.items():
            weight = state[f"blocks.{i}.{ours}.weight"]  # Linear (out, in); LayerNorm (C,)
            out[f"transformer.h.{i}.{theirs}.weight"] = weight.t() if conv1d else weight
            out[f"transformer.h.{i}.{theirs}.bias"] = bias_of(f"blocks.{i}.{ours}",
                                                              weight.shape[0])
    if not cfg.tie_embeddings:  # tied: transformers ties lm_head to wte itself, stores one
        out["lm_head.weight"] = state["head.lm_head.weight"]
    # contiguous copies: safetensors refuses shared or strided storage (a transposed view)
    return {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}


def export_hf(model: GPT, out_dir: str, tokenizer: dict[str, Any] | None = None) -> list[str]:
    """Write `model` (a plain GPT) as a `GPT2LMHeadModel` directory; returns the two paths.
    `tokenizer`: the entry config.json's "ringtrain" keeps (formats/tokenizer.py, its file
    already in `out_dir`)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, WEIGHTS), os.path.join(out_dir, CONFIG)]
    safetensors.torch.save_file(to_hf_state(model), paths[0] + ".tmp", metadata={"format": "pt"})
    os.replace(paths[0] + ".tmp", paths[0])
    config = hf_config(model.config)
    if tokenizer is not None:
        config[MARK]["tokenizer"] = tokenizer
    with open(paths[1] + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(paths[1] + ".tmp", paths[1])
    return paths


# -- GPT-2 -> ringtrain ------------------------------------------------------------------------

def is_hf_gpt2(path: str) -> bool:
    """Whether `path` holds a transformers config.json of model_type gpt2."""
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False


def gpt_config(hf: dict[str, Any], *, bias: bool = True) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json, or a FormatError naming what ringtrain's GPT lacks
    and the fix."""
    c = {**_DEFAULTS, **hf}
    wrong = []
    if c["activation_function"] != "gelu":
        wrong.append(f"activation_function={c['activation_function']!r}: ringtrain's GPT has exact "
                     "GELU only (\"gelu\"); the tanh approximation would change every MLP output")
    if c["layer_norm_epsilon"] != EPS:
        wrong.append(f"layer_norm_epsilon={c['layer_norm_epsilon']}: ringtrain's LayerNorms use "
                     f"{EPS}")
    if c["n_inner"] not in (None, 4 * c["n_embd"]):
        wrong.append(f"n_inner={c['n_inner']}: ringtrain's MLP is 4 * n_embd = {4 * c['n_embd']}")
    if not c["scale_attn_weights"] or c["scale_attn_by_inverse_layer_idx"]:
        wrong.append("scale_attn_weights must be true and scale_attn_by_inverse_layer_idx false: "
                     "ringtrain scales attention by 1/sqrt(head size) only")
    if c["add_cross_attention"]:
        wrong.append("add_cross_attention=true: ringtrain's GPT is decoder-only")
    drops = {c["resid_pdrop"], c["embd_pdrop"], c["attn_pdrop"]}
    if len(drops) > 1:
        wrong.append(f"resid_pdrop, embd_pdrop, attn_pdrop = {c['resid_pdrop']}, "
                     f"{c['embd_pdrop']}, {c['attn_pdrop']}: ringtrain's GPT has one dropout; "
                     "set the three equal in config.json")
    if wrong:
        raise FormatError("this GPT-2 model cannot be loaded into ringtrain's GPT without "
                          "changing what it computes: " + "; ".join(wrong))
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                     n_head=c["n_head"], n_embd=c["n_embd"], dropout=float(drops.pop()),
                     tie_embeddings=bool(c["tie_word_embeddings"]), bias=bias)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors (one file or save_pretrained's shards)."""
    load = safetensors.torch.load_file
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise FormatError(f"{path}: no {WEIGHTS} (nor {INDEX}); save the model with "
                          "`save_pretrained(DIR)` (safetensors, the default), not a .bin")
    state = {}
    for name in files:
        state.update(load(os.path.join(path, name)))
    # The original GPT-2 files name the body without "transformer." and keep the causal mask
    # buffers (attn.bias, attn.masked_bias), which are no weights.
    return {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
            for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


def from_hf_state(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """ringtrain's state dict from GPT-2's (`to_hf_state` backwards), in `GPT.state_dict()`'s
    order; a FormatError names the missing and unexpected tensors."""
    hf = dict(hf)
    out: dict[str, torch.Tensor | None] = {}

    def take(ours: str, theirs: str, conv1d: bool = False) -> None:
        weight = hf.pop(f"{theirs}.weight", None)
        out[f"{ours}.weight"] = weight.t() if conv1d and weight is not None else weight
        bias = hf.pop(f"{theirs}.bias", None)  # GPT-2 always has one; bias=False: all zero
        if config.bias:
            out[f"{ours}.bias"] = bias

    out["embed.wte.weight"] = hf.pop("transformer.wte.weight", None)
    out["embed.wpe.weight"] = hf.pop("transformer.wpe.weight", None)
    for i in range(config.n_layer):
        for ours, (theirs, conv1d) in _BLOCK.items():
            take(f"blocks.{i}.{ours}", f"transformer.h.{i}.{theirs}", conv1d)
    take("head.ln_f", "transformer.ln_f")
    lm_head = hf.pop("lm_head.weight", None)
    wte = out["embed.wte.weight"]
    if config.tie_embeddings and lm_head is not None and wte is not None \
            and not torch.equal(lm_head, wte):
        raise FormatError("config.json says tie_word_embeddings=true but lm_head.weight differs "
                          "from transformer.wte.weight; set tie_word_embeddings to false")
    out["head.lm_head.weight"] = wte if config.tie_embeddings else lm_head
    missing = sorted(k for k, v in out.items() if v is None)
    if missing or hf:
        raise FormatError(f"the GPT-2 weights do not match its config.json (n_layer="
                          f"{config.n_layer}, tie_word_embeddings={config.tie_embeddings}): "
                          f"missing {missing}, unexpected {sorted(hf)}")
    return {k: v.contiguous() for k, v in out.items() if v is not None}


def read_hf(path: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The GPTConfig and ringtrain state dict of a `GPT2LMHeadModel` directory."""
    with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
        hf_cfg = json.load(f)
    weights = _read_weights(path)
    # bias=False went out as zero biases, marked; a marked model whose biases have moved since
    # (fine-tuned in transformers) keeps them: bias=True holds it exactly.
    bias = not (hf_cfg.get(MARK, {}).get("bias") is False
                and all(not v.any() for k, v in weights.items() if k.endswith(".bias")))
    config = gpt_config(hf_cfg, bias=bias)
    return config, from_hf_state(weights, config)


def load_hf(path: str) -> GPT:
    """ringtrain's GPT holding a `GPT2LMHeadModel` directory's weights, in eval mode."""
    config, state = read_hf(path)
    model = GPT(config)
    model.load_state_dict(state)
    return model.eval()
