"""A wrapper's `load_state_dict` takes the wrapped module's own keys too, without `module.`.

    accept_unwrapped_keys(wrapper)   # in DistributedDataParallel's and ZeroDataParallel's init

torch's DDP saves every key as `module.<name>` and loads only that form, so a state dict saved
from the plain model (or unwrapped on the way, as ringtrain's snapshots and exports are) fails
with a list of every key as missing and unexpected. Here the plain form is renamed before the
load, where it is the one given: no key under the wrapper's prefix starts with `module.` and at
least one is the wrapped module's. Anything else (torch's own form, a mistake) loads, or fails,
as in torch. The other direction, a plain model loading a wrapper's dict, is
`ringtrain.checkpoint.files.load_model_state_dict`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

WRAPPED = "module."


def accept_unwrapped_keys(wrapper: nn.Module) -> None:
    """Let `wrapper.load_state_dict` (and a parent's) take the plain keys of `wrapper.module`."""
    wrapper.register_load_state_dict_pre_hook(_add_prefix)


def _add_prefix(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    ours = [k for k in state_dict if k.startswith(prefix)]
    if not ours or any(k.startswith(prefix + WRAPPED) for k in ours):
        return
    own = set(wrapper.module.state_dict(keep_vars=True))  # names only: no tensor is copied
    if not any(k[len(prefix):] in own for k in ours):
        return
    for k in ours:  # in place: torch's loader reads the dict it handed the hook
        state_dict[prefix + WRAPPED + k[len(prefix):]] = state_dict.pop(k)
