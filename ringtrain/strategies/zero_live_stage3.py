"""What ZeRO stage 3 changes in live recovery: the parameters live in the shards alone.

    model = BuffersOnly(strategy.module)    # what the live loop commits and heals of the model
    give_storage(zero)                      # before the wrapper is built over a new generation

At stage 3 a parameter has no storage between its uses (the wrapper gathers it for forward and
backward, then frees it), and each member's slice of the parameters is in the shard parts
`ZeroLiveHooks` keeps (`zero_live.py`). So the model the loop commits, restores and heals
(`LiveState`) is its buffers alone, replicated as a stage-2 model is; and a new generation's
wrapper, which copies the parameters at construction, is built on zeros for them (the load
that follows sets each shard). Apart from `zero_live.py`'s rule (buddy copies, the commit, the
re-shard), which is the same at every stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["BuffersOnly", "give_storage"]


class BuffersOnly(nn.Module):
    """A stage-3 model as the live loop commits, restores and heals it (`LiveState`): its
    buffers alone, replicated as a stage-2 model is. Never its parameters: between uses they
    have no storage (reading one crashes the process), and each member's slice of them is in
    the commit's parts `ZeroLiveHooks` keeps (a heal would send a whole replica nobody holds).

    Args:
        module: the plain module `ZeroDataParallel` wraps (not a submodule of this one, so its
            parameters stay out of `parameters()` and `zero_grad()`).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["_module"] = module
        self._params = {n for n, _ in module.named_parameters(remove_duplicate=False)}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k: v for k, v in self._module.state_dict().items() if k not in self._params}

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        unexpected = sorted(set(state_dict) & self._params)
        if unexpected:
            raise ValueError(f"a stage-3 live commit holds buffers only, got parameters "
                             f"{unexpected[:3]}: it was taken from another stage")
        return self._module.load_state_dict(state_dict, strict=False, assign=assign)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A restore after a step that failed in backward: gradients autograd accumulated into
        # `.grad` before their unit was reduced would be added to the redone step's.
        self._module.zero_grad(set_to_none=set_to_none)


def give_storage(zero: Any) -> None:
    """Stage 3, before the wrapper is built again over a new group: the old one's parameters
    have no storage (freed between uses; the group that would gather them is gone), and the
    new one copies them at construction. Zeros for the copy (one model, as at setup, dropped
    once the new wrapper has its units); the load that follows sets each shard. Gradients a
    failed backward left go too (the redone step's would be added to them)."""
    with torch.no_grad():
        for unit in zero.units:
            for p in unit.params:
                p.data = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                p.grad = None
