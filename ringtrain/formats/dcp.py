"""ringtrain's GPT <-> a torch distributed checkpoint (DCP) directory.

    python -c "from ringtrain.formats.dcp import export_dcp; from ringtrain.models import \
GPT, GPTConfig; export_dcp(GPT(GPTConfig(vocab_size=10, block_size=8)), 'dcp_dir')"

The directory is what `torch.distributed.checkpoint.save` writes (`.metadata` and
`__0_0.distcp`), holding {"model": GPT.state_dict()}: DCP flattens it to "model.embed.wte.weight"
and so on, the layout torchtitan and torch's own examples use. Load it on any world size:

    state = {"model": model.state_dict()}                # every rank, its own copy or shard
    torch.distributed.checkpoint.load(state, checkpoint_id="dcp_dir")

`ringtrain export` adds ringtrain's `model_config.json` (the GPT's shape) next to it; DCP
ignores the file, and `--init-from` reads the shape from it. Written by one process without a
process group (`no_dist`); read the same way, so each rank of a run reads the whole model.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ringtrain.models.export import CONFIG, FORMAT
from ringtrain.models.gpt import GPT, GPTConfig

METADATA = ".metadata"  # DCP's index of a checkpoint: its presence says "a DCP directory"
PREFIX = "model."  # the top-level key of the saved dict, as DCP flattens it
# dcp.save/load warn on every single-process call, even one that says no_dist=True
_SINGLE = "torch.distributed is disabled, unavailable or uninitialized"


def is_dcp(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def export_dcp(model: GPT, out_dir: str, tokenizer: dict[str, Any] | None = None) -> list[str]:
    """Write `model`'s weights as a DCP directory (+ model_config.json, with `tokenizer`'s
    entry where given: formats/tokenizer.py, its file already in `out_dir`); returns the
    paths."""
    os.makedirs(out_dir, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        # A tied weight is one storage under two names: each gets its own bytes, so a reader
        # that loads one name only (or a model that does not tie) finds both.
        ptr = tensor.untyped_storage().data_ptr()
        state[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE)
        # `ringtrain export` replaces an earlier dcp export only (cli/export._in_the_way)
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save({"model": state}, checkpoint_id=out_dir, no_dist=True)
    config = os.path.join(out_dir, CONFIG)
    with open(config + ".tmp", "w", encoding="utf-8") as f:
        own = {"format": FORMAT, "version": 1, "model": asdict(model.config)}
        if tokenizer is not None:
            own["tokenizer"] = tokenizer
        json.dump(own, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(config + ".tmp", config)
    return sorted(os.path.join(out_dir, n) for n in os.listdir(out_dir))


def read_dcp(path: str) -> tuple[GPTConfig | None, dict[str, torch.Tensor]]:
    """The tensors under "model." of a DCP directory (names without it), read whole in this
    process, and the GPTConfig of its model_config.json (None where there is none)."""
    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    # The template says each tensor's shape and dtype; dcp.load fills it in place.
    state: dict[str, Any] = {
        key[len(PREFIX):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(PREFIX) and isinstance(meta, dcp.TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{path}: a distributed checkpoint without tensors under 'model.' "
                         f"(its keys: {sorted(entries)[:5]}...); save the model's state_dict as "
                         "{'model': model.state_dict()}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE)
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    config = None
    if os.path.exists(os.path.join(path, CONFIG)):
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            config = GPTConfig(**json.load(f)["model"])
    return config, state
