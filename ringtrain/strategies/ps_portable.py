"""A parameter-server snapshot in the layout-free form (`ringtrain.strategies.portable`).

    model, optimizer = named_state([part["server"] for part in server_parts])  # ps -> any
    rows, state = piece_state(model, optimizer["state"], pieces, param_pieces)  # any -> a server

Each server's part holds its pieces (row chunks of parameters, `ringtrain.ps.sharding`) laid
out one after another in one flat buffer, in model order, and the state of an optimizer over one
Parameter per piece (`param_pieces`: the piece of each of its parameters, in its own numbering).
A whole parameter is its pieces' rows put back in order; its optimizer state (AdamW's moments,
shaped like the rows) is put together the same way, and the step is the pieces' own: the
conversion is exact.

Pure functions on the saved dicts: `.venv/bin/pytest -q tests/test_ps_portable.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringtrain.ps.sharding import piece_view
from ringtrain.strategies.portable import is_moment

__all__ = ["named_state", "piece_state"]


def named_state(servers: Sequence[Mapping[str, Any]]
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every server's part (`ParameterServer.state_dict()`) -> (the parameters by name, their
    optimizer state by name: {"state": {name: {...}}}). Raises KeyError on a part saved
    without `param_pieces` (the caller says which ringtrain wrote it)."""
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    moments: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for server in servers:
        pieces = [(str(name), int(start), tuple(int(x) for x in shape))
                  for name, start, _end, shape in server["pieces"]]
        flat, offset = server["flat"], 0
        for name, start, shape in pieces:  # laid out one after another (`plan_shards`)
            numel = math.prod(shape)
            rows.setdefault(name, []).append((start, flat[offset:offset + numel].view(shape)))
            offset += numel
        saved = server["optimizer"]
        numbered = [i for group in saved["param_groups"] for i in group["params"]]
        for i, piece in zip(numbered, server["param_pieces"], strict=True):
            if i in saved["state"]:  # none before the first step
                name, start, _ = pieces[piece]
                moments.setdefault(name, []).append((start, saved["state"][i]))
    model = {name: _joined([t for _, t in sorted(chunks, key=lambda c: c[0])])
             for name, chunks in rows.items()}
    state = {}
    for name, chunks in moments.items():
        parts = [s for _, s in sorted(chunks, key=lambda c: c[0])]
        state[name] = {key: _joined([p[key] for p in parts]) if is_moment(key, value) else value
                       for key, value in parts[0].items()}
    return model, {"state": state}


def piece_state(model: Mapping[str, torch.Tensor], moments: Mapping[str, Mapping[str, Any]],
                pieces: Sequence[Any], param_pieces: Sequence[int]
                ) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """The inverse, for one server: its pieces' rows of the whole parameters (`pieces`: its
    `ringtrain.ps.sharding.Piece`s, in its flat order) and its optimizer's state in the
    optimizer's own numbering (`param_pieces`: the piece of each of its parameters). A parameter
    without saved state (a snapshot before the first step) gets none. Raises ValueError naming
    a parameter the model lacks."""
    missing = sorted({p.name for p in pieces} - set(model))
    if missing:
        raise ValueError(f"the snapshot has no parameter {missing[0]!r}: it was saved from "
                         "another model; resume with the model options it was saved with")
    rows = [piece_view(model[p.name], p).clone() for p in pieces]
    state = {}
    for i, piece_index in enumerate(param_pieces):
        piece = pieces[piece_index]
        if piece.name in moments:
            state[i] = {key: piece_view(value, piece).clone() if is_moment(key, value) else
                        (value.clone() if isinstance(value, torch.Tensor) else value)
                        for key, value in moments[piece.name].items()}
    return rows, state


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0].clone() if len(chunks) == 1 else torch.cat(chunks, dim=0)
