"""A trained GPT as plain files: `model.safetensors` (the weights) and `model_config.json`.

    python -c "from ringtrain.models.export import load_model; m, cfg = load_model('runs/x'); \
print(cfg)"


`ringtrain train` writes both into its run directory at the end. The weights are a flat
name -> tensor map (`safetensors`: no pickle, nothing executes on load), with the names of
`GPT.state_dict()`; a tied token embedding is stored under both of its names, so
`load_state_dict` works whether or not the loading model ties them. `model_config.json`:

    {"format": "ringtrain-gpt", "version": 1,
     "model": {vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_embeddings, bias},
     "tokenizer": {"type": "char", "chars": [...]} | {"type": "bpe", "file": "tokenizer.json"}
                  | {"type": "digits"}   (the addition task: token i is the digit i)}

Loading needs no ringtrain: `safetensors.torch.load_file` and `json.load` (docs/train.md shows
the lines, and loading into ringtrain's GPT). Models import nothing of ringtrain's distributed
parts.

"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from typing import Any

import torch

from ringtrain.models.gpt import GPT, GPTConfig

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
FORMAT = "ringtrain-gpt"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("exporting or loading model.safetensors needs `safetensors`: pip install "
                          "safetensors (ringtrain depends on it)") from None
    return safetensors.torch


def dataset_tokenizer(directory: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer entry of a prepared dataset (`directory` and its meta.json), a BPE's file
    named by its absolute path."""
    if meta["tokenizer"] == "char":
        return {"type": "char", "chars": list(meta["chars"])}
    return {"type": "bpe", "file": os.path.join(os.path.abspath(directory),
                                                meta["tokenizer_file"])}


def portable(entry: dict[str, Any] | None, out_dir: str) -> dict[str, Any] | None:
    """`entry` as an export in `out_dir` records it: a BPE's tokenizer.json copied there, and
    named relative to it."""
    if entry is None or entry["type"] != "bpe":
        return entry
    name = os.path.basename(entry["file"])
    dst = os.path.join(out_dir, name)
    if os.path.abspath(entry["file"]) != os.path.abspath(dst):
        shutil.copyfile(entry["file"], dst)
    return {"type": "bpe", "file": name}


def data_tokenizer(tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    """The entry of `ringtrain train`'s data: its prepared dataset's ({"dir", "meta"}), or
    (None) the addition task's, whose token i is the digit i."""
    return dataset_tokenizer(tokenizer["dir"], tokenizer["meta"]) if tokenizer else {
        "type": "digits"}


def tokenizer_entry(tokenizer: dict[str, Any] | None, out_dir: str) -> dict[str, Any]:
    """model_config.json's tokenizer from a prepared dataset's {"dir", "meta"} (None: digits);
    a BPE's tokenizer.json is copied next to the weights."""
    return portable(data_tokenizer(tokenizer), out_dir)


def export_model(model: GPT, out_dir: str, *, tokenizer: dict[str, Any] | None = None) -> list[str]:
    """Write `model`'s weights and config into `out_dir`; returns the two paths.

    Args:
        model: a plain GPT (not wrapped) holding the final weights.
        out_dir: a directory (created).
        tokenizer: {"dir": prepared dataset directory, "meta": its meta.json}, or None for the
            addition task's digits.
    """
    os.makedirs(out_dir, exist_ok=True)
    # Tied weights are one tensor under two names, and safetensors refuses shared storage: a
    # name whose storage was already seen gets its own copy. Nothing else is copied (on CPU),
    # so the export costs the tied embedding, not a second model.
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        state[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    paths = [os.path.join(out_dir, WEIGHTS), os.path.join(out_dir, CONFIG)]
    config = {"format": FORMAT, "version": 1, "model": asdict(model.config),
              "tokenizer": tokenizer_entry(tokenizer, out_dir)}
    _safetensors().save_file(state, paths[0] + ".tmp", metadata={"format": "pt"})
    os.replace(paths[0] + ".tmp", paths[0])
    with open(paths[1] + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(paths[1] + ".tmp", paths[1])
    return paths


def read_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no exported model (a run writes it when it finishes)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_model(run_dir: str) -> tuple[GPT, dict[str, Any]]:
    """The exported GPT of `run_dir` (eval mode, CPU) and its model_config.json."""
    config = read_config(run_dir)
    model = GPT(GPTConfig(**config["model"]))
    state = _safetensors().load_file(os.path.join(run_dir, WEIGHTS))
    model.load_state_dict(state)
    return model.eval(), config


def state_to_model(state: dict[str, torch.Tensor], model_config: dict[str, Any]) -> GPT:
    """A GPT built from a model_config's "model" entry, holding `state`, in eval mode."""
    model = GPT(GPTConfig(**model_config))
    model.load_state_dict(state)
    return model.eval()
