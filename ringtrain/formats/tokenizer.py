"""The tokenizer a model was trained with, carried by each export and checked by `--init-from`.

    python -c "from ringtrain.formats.tokenizer import read_tokenizer; print(read_tokenizer('d'))"

A model's token ids mean what its tokenizer made them mean. A run started `--init-from` a model
on data tokenized otherwise, with the same vocabulary size, reads every token as another one and
trains on without an error (its loss starts high and the model's knowledge is lost). So each
export records the entry of models/export.py's model_config.json:

    {"type": "char", "chars": [...]} | {"type": "bpe", "file": "tokenizer.json"}
    | {"type": "digits"}

in model_config.json (ringtrain's own export, and DCP's) or in config.json's "ringtrain" entry
(transformers GPT-2; transformers keeps unknown keys), a BPE's tokenizer.json copied beside it
(`PreTrainedTokenizerFast(tokenizer_file=...)` reads it). `--init-from` compares it with the
run's data (`difference`); `ringtrain prepare --tokenizer-from DIR` tokenizes new text with it.
A directory that records none (a model transformers made) is not checked: nothing to compare.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ringtrain.formats.hf_gpt2 import CONFIG as HF_CONFIG
from ringtrain.formats.hf_gpt2 import MARK, is_hf_gpt2
from ringtrain.models.export import CONFIG
from ringtrain.models.export import data_tokenizer as data_tokenizer  # re-exported:
from ringtrain.models.export import dataset_tokenizer as dataset_tokenizer
from ringtrain.models.export import portable as portable  # the whole story in one module

KEY = "tokenizer"


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_tokenizer(path: str) -> dict[str, Any] | None:
    """The tokenizer entry the model directory `path` records (a BPE's "file" made absolute),
    or None where it records none."""
    own = _json(os.path.join(path, CONFIG))  # ringtrain's export, a run directory, a DCP's
    if own is not None:
        entry = own.get(KEY)
    elif is_hf_gpt2(path):
        entry = (_json(os.path.join(path, HF_CONFIG)) or {}).get(MARK, {}).get(KEY)
    else:
        entry = None
    if not isinstance(entry, dict) or "type" not in entry:
        return None
    if entry["type"] == "bpe":
        entry = {**entry, "file": os.path.join(os.path.abspath(path), entry["file"])}
    return entry


def _describe(entry: dict[str, Any]) -> str:
    if entry["type"] == "char":
        return f"a char tokenizer of {len(entry['chars'])} characters"
    if entry["type"] == "bpe":
        return f"the BPE of {entry['file']}"
    return "the addition task's digits"


def _bpe_model(path: str) -> Any:
    data = _json(path)
    if data is None:
        return ("unreadable", path)  # differs from every readable one, and says which
    return data.get("model"), data.get("pre_tokenizer")  # vocab and merges; how text is split


def difference(source: dict[str, Any], target: dict[str, Any]) -> str | None:
    """How the tokenizer of a model (`source`) differs from the run's (`target`); None: the
    same (a token id means the same text in both)."""
    if source["type"] != target["type"]:
        return f"the model was trained with {_describe(source)}, the data is {_describe(target)}"
    if source["type"] == "char" and source["chars"] != target["chars"]:
        a, b = source["chars"], target["chars"]
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        only = sorted(set(b) - set(a))
        return (f"the model's char tokenizer has {len(a)} characters, the data's {len(b)}, and "
                f"token {i} is {a[i]!r} in the model's but {b[i]!r} in the data's"
                if i < min(len(a), len(b)) else
                f"the model's char tokenizer has {len(a)} characters, the data's {len(b)}") + (
                f" (the data has characters the model never saw: {''.join(only[:20])!r})"
                if only else "")
    if source["type"] == "bpe" and _bpe_model(source["file"]) != _bpe_model(target["file"]):
        return (f"the model's BPE ({source['file']}) and the data's ({target['file']}) have "
                "other vocabularies or merges")
    return None


def fingerprint(entry: dict[str, Any]) -> str:
    """What a snapshot records of the data's tokenizer, to compare on resume: the kind, the
    vocabulary size, and a digest of what fixes every id ("char, 29 tokens, 3f2a9c1b04de")."""
    if entry["type"] == "char":
        size, what = len(entry["chars"]), "".join(entry["chars"])
    elif entry["type"] == "bpe":
        model = _bpe_model(entry["file"])
        vocab = model[0].get("vocab", {}) if isinstance(model[0], dict) else {}
        size, what = len(vocab), json.dumps(model, sort_keys=True)
    else:
        return "the addition task's digits"
    return f"{entry['type']}, {size} tokens, {hashlib.sha256(what.encode()).hexdigest()[:12]}"
