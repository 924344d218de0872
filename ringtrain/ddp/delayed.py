"""`delay_all_reduce_named_params` / `param_to_hook_all_reduce`: torch's delayed all-reduce.

Some parameters are averaged outside the buckets, all at once, when one chosen parameter's
gradient is computed (torch uses it to push the all-reduce of, e.g., embeddings to a point in
backward where it overlaps the rest). As in torch: their `.grad` are views into one flat buffer
(set after each forward where a `.grad` is None), the buffer is divided by the world size and
all-reduced from a hook on `param_to_hook_all_reduce`'s gradient, and the reducer ignores these
parameters. Unlike torch on gloo, the end of backward waits for that all-reduce, so the
optimizer never reads a gradient still being summed.

Tests: `.venv/bin/pytest -q tests/test_ddp_ctor_args.py -k delay`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp.ctor_args import DDPArgumentError
from ringtrain.torch_internals import backward_tls_free, queue_backward_callback


def delayed_names(module: nn.Module, named: Sequence[tuple[str, nn.Parameter]],
                  hook_param: nn.Parameter) -> tuple[list[str], str]:
    """Names (in `module`) of the delayed parameters and of the hooked one, checked."""
    by_id = {id(p): n for n, p in module.named_parameters()}
    names = [by_id.get(id(p)) for _, p in named]
    missing = [given for (given, _), found in zip(named, names, strict=True) if found is None]
    if missing or id(hook_param) not in by_id:
        raise DDPArgumentError(
            f"delay_all_reduce_named_params / param_to_hook_all_reduce must be parameters of the "
            f"wrapped module; not found: {missing or ['param_to_hook_all_reduce']}")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise DDPArgumentError(
            f"delay_all_reduce_named_params mixes dtypes {sorted(map(str, dtypes))}: their "
            "gradients share one flat buffer; delay parameters of one dtype")
    return [n for n in names if n is not None], by_id[id(hook_param)]


class DelayedAllReduce:
    """The flat gradient buffer of the delayed parameters and the hook that averages it.

    Args:
        params: the delayed parameters (one dtype, one device).
        hook_param: the parameter whose gradient triggers the all-reduce.
        process_group: the group to average over.
    """

    def __init__(self, params: Sequence[nn.Parameter], hook_param: nn.Parameter,
                 process_group: dist.ProcessGroup):
        self.params, self.process_group = list(params), process_group
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                                  device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._work: Any = None
        self._handle = hook_param.register_hook(functools.partial(_launch, weakref.ref(self)))
        weakref.finalize(self, self._handle.remove)  # the hook lives on the user's parameter

    def after_forward(self) -> None:
        """Point `.grad` of the delayed parameters into the buffer (torch's _clear_grad_buffer)."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()

    def launch(self) -> None:
        self.buffer.div_(self.process_group.size())
        self._work = collectives.all_reduce(self.buffer, group=self.process_group, async_op=True)
        queue_backward_callback(functools.partial(_wait, weakref.ref(self)))

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def remove_hook(self) -> None:
        self._handle.remove()


def _launch(ref: weakref.ref, grad: torch.Tensor) -> None:
    delayed = ref()
    if delayed is not None:
        with backward_tls_free():  # see ringtrain.torch_internals: the Work must hold no Python
            delayed.launch()


def _wait(ref: weakref.ref) -> None:
    delayed = ref()
    if delayed is not None:
        delayed.wait()
