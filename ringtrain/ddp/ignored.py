"""Parameters and buffers kept out of `DistributedDataParallel`, the way torch's DDP keeps them.

torch offers one way to say "DDP, leave these alone": before wrapping,

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])

which records the fully qualified names on the module (`_ddp_params_and_buffers_to_ignore`) and
flags each named tensor (`_ddp_ignored`). Frameworks and user code call it (for parameters
materialised later, sharded elsewhere, or kept rank-local). An ignored parameter is not checked,
broadcast or averaged, and its `.grad` is never touched; an ignored buffer is not broadcast.
Both may differ between ranks. `delay_all_reduce_named_params` adds its names to the same set
(they are averaged apart, `delayed.py`).

Tests: `.venv/bin/pytest -q tests/test_ddp_dropin.py -k ignore`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"  # torch's names, read by torch's code too
IGNORED_FLAG = "_ddp_ignored"


def set_params_and_buffers_to_ignore_for_model(module: nn.Module,
                                               params_and_buffers_to_ignore: Iterable[str]) -> None:
    """Have DDP ignore these parameters and buffers of `module` (call it before wrapping).

    Args:
        module: the plain model, not yet wrapped.
        params_and_buffers_to_ignore: fully qualified names, `{module_name}.{param_name}`
            (`"fc.weight"`, `"bn.running_mean"`), as `named_parameters()` gives them.
    """
    module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
    for name, param in module.named_parameters():
        if name in params_and_buffers_to_ignore:
            param._ddp_ignored = True
    for name, buffer in module.named_buffers():
        if name in params_and_buffers_to_ignore:
            buffer._ddp_ignored = True


def get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator:
    """The parameters of `module` DDP manages (not flagged ignored); (name, param) if asked."""
    for param in module.parameters() if not named_params else module.named_parameters():
        # named_parameters() gives pairs: the flag is on the tensor.
        tensor = param[1] if named_params else param
        if not hasattr(tensor, IGNORED_FLAG):
            yield param


def ignored_names(module: nn.Module) -> set[str]:
    """The names the module asked DDP to ignore (empty if it never asked)."""
    return set(getattr(module, IGNORE_ATTR, ()))


def managed_parameters(module: nn.Module, ignored: set[str]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter DDP averages: requires grad and not ignored."""
    return [(n, p) for n, p in module.named_parameters()
            if p.requires_grad and n not in ignored]


def synced_parameters(module: nn.Module, ignored: set[str]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter checked and broadcast at construction."""
    return [(n, p) for n, p in module.named_parameters() if n not in ignored]


def named_synced_buffers(module: nn.Module, ignored: set[str]) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer that follows rank 0."""
    return [(n, b) for n, b in module.named_buffers() if n not in ignored]


def synced_buffers(module: nn.Module, ignored: set[str]) -> list[torch.Tensor]:
    """The buffers that follow rank 0 (re-read each time: a module may reassign one)."""
    return [b for _, b in named_synced_buffers(module, ignored)]
