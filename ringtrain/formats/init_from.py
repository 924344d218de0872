"""`--init-from DIR`: start a GPT from the weights of a directory in any format ringtrain reads.

    python -c "from ringtrain.formats.init_from import read_weights; print(read_weights('d')[0])"

The format is told by the files: DCP's `.metadata` (a torch distributed checkpoint), ringtrain's
`model_config.json` (an exported run: `ringtrain train`'s run directory, `ringtrain export`),
or a config.json of model_type gpt2 (a transformers `GPT2LMHeadModel`). A run directory holds
both a config.json (its options) and model_config.json: the latter decides.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from typing import Any

import torch

from ringtrain.formats.dcp import is_dcp, read_dcp
from ringtrain.formats.hf_gpt2 import CONFIG as HF_CONFIG
from ringtrain.formats.hf_gpt2 import MARK, FormatError, gpt_config, is_hf_gpt2, read_hf
from ringtrain.models.export import CONFIG, WEIGHTS, read_config
from ringtrain.models.gpt import GPT, GPTConfig

# GPTConfig fields the weights fix (dropout and activation checkpointing are the run's own;
# the block size may be smaller than the source's: its first positions are kept)
SHAPE = ("vocab_size", "n_layer", "n_head", "n_embd", "bias", "tie_embeddings")


def detect(path: str) -> str:
    """'dcp', 'ringtrain' or 'hf' for the directory `path`, or a FormatError saying what it
    holds instead."""
    if not os.path.isdir(path):
        raise FormatError(f"init_from={path}: no such directory")
    if is_dcp(path):
        return "dcp"
    if os.path.exists(os.path.join(path, CONFIG)) and os.path.exists(os.path.join(path, WEIGHTS)):
        return "ringtrain"
    if is_hf_gpt2(path):
        return "hf"
    if os.path.isdir(os.path.join(path, "snapshots")):  # a `ringtrain train` run not finished
        raise FormatError(f"init_from={path}: a run that has not finished (no {WEIGHTS} yet: it "
                          "is written at the end); give a finished run, or first export its "
                          f"newest snapshot: ringtrain export {path} OUT_DIR --format dcp, then "
                          "--init-from OUT_DIR")
    raise FormatError(f"init_from={path}: neither a torch distributed checkpoint (.metadata), "
                      f"an exported ringtrain model ({WEIGHTS} + {CONFIG}) nor a transformers "
                      "GPT-2 directory (config.json of model_type gpt2); give one of those")


def read_weights(path: str) -> tuple[GPTConfig | None, dict[str, torch.Tensor]]:
    """The GPTConfig (None: a DCP directory without model_config.json) and ringtrain state dict
    the directory holds."""
    kind = detect(path)
    if kind == "dcp":
        return read_dcp(path)
    if kind == "hf":
        return read_hf(path)
    from ringtrain.models.export import load_model

    model, _ = load_model(path)
    return model.config, model.state_dict()


def source_config(path: str) -> GPTConfig | None:
    """The GPTConfig of the model in `path`, from its config file alone (None: a DCP directory
    without model_config.json); a quick check before any weight is read."""
    kind = detect(path)
    if kind == "ringtrain" or (kind == "dcp" and os.path.exists(os.path.join(path, CONFIG))):
        return GPTConfig(**read_config(path)["model"])
    if kind == "dcp":
        return None
    with open(os.path.join(path, HF_CONFIG), encoding="utf-8") as f:
        hf = json.load(f)
    return gpt_config(hf, bias=hf.get(MARK, {}).get("bias", True))


def shape_options(path: str) -> dict[str, Any]:
    """The model options that `path`'s model fixes, for a run that starts from it and sets
    none of them itself: its layers, heads, width, biases and tied embeddings (not its
    dropout, a training choice, nor its positions: a run may use fewer). {} where the
    directory cannot be read as a model here: the run's own checks then say why."""
    try:
        source = source_config(path)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {} if source is None else {f: getattr(source, f) for f in SHAPE if f != "vocab_size"}


def check_shape(source: GPTConfig | None, target: dict[str, Any], path: str) -> None:
    """A FormatError (a ValueError) naming the fields where the run's model (`target`: some or
    all of GPTConfig's fields) is not the one `path` holds (`source`), with the values that
    would fit (`n_layer=12`, which the command line says as `--n-layer 12`)."""
    if source is None:
        return
    differ = [f for f in SHAPE if f in target and getattr(source, f) != target[f]]
    if target.get("block_size", 0) > source.block_size:
        differ.append("block_size")
    if differ:
        theirs = ", ".join(f"{f}={getattr(source, f)}" for f in differ)
        ours = ", ".join(f"{f}={target[f]}" for f in differ)
        raise FormatError(f"init_from={path} holds a GPT with {theirs} ({source.block_size} "
                          f"positions), but this run builds {ours}; leave those out (a run "
                          "takes its model's shape) or give its values, or drop init_from")


# The tensors with a row per vocabulary entry (the GPT's names).
VOCAB_ROWS = ("embed.wte.weight", "head.lm_head.weight")


def with_rows(source: GPTConfig | None, rows: int, tokens: int | None) -> GPTConfig | None:
    """`source` as a model of `rows` vocabulary rows where only its padding differs: both
    cover the `tokens` token ids (another --pad-vocab; GPT-2's 50257 in nanoGPT's 50304)."""
    if source is None or tokens is None or not tokens <= min(source.vocab_size, rows):
        return source
    return replace(source, vocab_size=rows)


def load_into(model: GPT, path: str, tokens: int | None = None) -> GPT:
    """`model` holding the weights of `path` (in place; returned). The model's shape must be
    the directory's (`check_shape`); a smaller block_size keeps the first positions; with
    `tokens` (the data's token ids), a vocabulary padded otherwise gives its first `tokens`
    rows, and the model's padding rows keep their initialisation (no token uses them)."""
    source, state = read_weights(path)
    padded = with_rows(source, model.config.vocab_size, tokens)
    if padded != source:  # another padding of the same tokens: theirs, the rest as initialised
        own = model.state_dict()
        for key in VOCAB_ROWS:
            if key in state:
                resized = own[key].detach().clone()
                resized[:tokens] = state[key][:tokens]
                state[key] = resized
    check_shape(padded, asdict(model.config), path)
    block = model.config.block_size
    wpe = state.get("embed.wpe.weight")
    if wpe is not None and wpe.shape[0] > block:
        # positions >= block_size are never looked up by this model: dropping them changes
        # no output on sequences it can take
        state["embed.wpe.weight"] = wpe[:block]
    try:
        with torch.no_grad():
            model.load_state_dict(state)
    except RuntimeError as e:
        raise FormatError(f"init_from={path}: its weights do not fit the run's model: "
                          f"{e}") from None
    return model
