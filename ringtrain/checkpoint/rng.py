"""Per-rank random number generator state: Python, NumPy, torch CPU and (when in use) CUDA.

Saved per global rank in every snapshot, so dropout masks and augmentations continue after a
resume exactly as they would have without it.

    state = get_rng_state()   # plain containers and tensors: torch.load(weights_only=True) reads it


    set_rng_state(state)

Tests: `.venv/bin/pytest -q tests/test_checkpoint.py -k rng`.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]

_PIECES = ("python", "numpy", "torch")


def _cuda_in_use() -> bool:
    # is_initialized() first: it never starts CUDA, so a CPU-only run touches nothing.
    return torch.cuda.is_initialized() and torch.cuda.is_available()


def get_rng_state() -> dict[str, Any]:
    """This process's generator states, in a form `torch.load(weights_only=True)` accepts.

    CUDA generators are included only when CUDA is available and already initialised (asking
    for them would otherwise start CUDA in a CPU-only process).
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # NumPy's MT19937 key is a uint32 array: stored as int64 so no pickled ndarray is needed.
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what `get_rng_state` saved; warn, naming each piece, about what is missing.

    A missing piece leaves that generator as it is, so the resumed run is no longer identical
    to an uninterrupted one: hence the warning rather than silence.
    """
    if state is None:
        warnings.warn(
            "no RNG state to restore for this rank (a snapshot from fewer ranks, or from a run "
            "that did not save it): Python, NumPy and torch generators keep their current state, "
            "so random numbers differ from an uninterrupted run",
            stacklevel=2,
        )
        return
    missing = [name for name in _PIECES if name not in state]
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state({
            "bit_generator": s["bit_generator"],
            "state": {"key": s["key"].numpy().astype(np.uint32), "pos": s["pos"]},
            "has_gauss": s["has_gauss"],
            "gauss": s["gauss"],
        })
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            missing.append(f"cuda (saved for {len(state['cuda'])} devices, {count} here)")
    elif _cuda_in_use():
        missing.append("cuda (not in the saved state)")
    if missing:
        warnings.warn(
            f"RNG state restored without {', '.join(missing)}: those generators keep their "
            "current state, so random numbers differ from an uninterrupted run",
            stacklevel=2,
        )
