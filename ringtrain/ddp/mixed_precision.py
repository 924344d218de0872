"""`DistributedDataParallel(..., mixed_precision=...)`: torch's DDP-native mixed precision.

torch's `_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` (or `MixedPrecision` below,
the same fields) means: the forward and backward compute in `param_dtype` (parameters and
floating-point inputs cast to it), gradients are summed across ranks in `reduce_dtype` (default:
`param_dtype`) and divided after the sum, buffers live in `buffer_dtype` (cast once, at
construction), while the parameters, their `.grad` and the optimizer stay in full precision.
Only floating-point tensors are cast; ignored parameters and buffers are left alone.

How, without touching the user's parameters: each forward calls the module through
`torch.func.functional_call` with low-precision copies made by a differentiable cast, so
backward hands each full-precision parameter the upcast of its low-precision gradient (the same
values) and the reducer's hooks fire on the real parameters; `mixed_precision_hook` replaces the
bucket all-reduce (as torch registers `_reducer_allreduce_and_upcast_hook`, so another comm hook
is refused, as in torch). torch's version swaps `param.data` and needs CUDA streams; this one
also runs on the CPU. Tests: `.venv/bin/pytest -q tests/test_ddp_ctor_args.py -k mixed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp.ctor_args import map_tensors


@dataclass
class MixedPrecision:
    """The fields of torch's `torch.nn.parallel.distributed._MixedPrecision` (either works)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


def check_config(config: Any) -> None:
    missing = [f for f in ("param_dtype", "reduce_dtype", "buffer_dtype")
               if not hasattr(config, f)]
    if missing:
        raise TypeError(f"mixed_precision={config!r} has no {missing}: pass torch's "
                        "_MixedPrecision or ringtrain.ddp.mixed_precision.MixedPrecision")


def reduce_dtype(config: Any) -> torch.dtype | None:
    """The dtype gradients are summed in; None: their own (no hook needed)."""
    return config.reduce_dtype if config.reduce_dtype is not None else config.param_dtype


def setup(module: nn.Module, config: Any, ignored: set[str]) -> None:
    """At construction: move the floating-point buffers to `buffer_dtype` for good, and tag
    the parameters as torch does (`_fp_param`: the full-precision data; `_mp_param`: an empty
    tensor of the compute dtype, where torch keeps one whose storage it frees between steps)."""
    for name, p in module.named_parameters():
        if name not in ignored and p.is_floating_point():
            p._fp_param = p.data
            p._mp_param = torch.empty(0, dtype=config.param_dtype or p.dtype, device=p.device)
    if config.buffer_dtype is None:
        return
    for name, buffer in module.named_buffers():
        if name not in ignored and buffer.is_floating_point():
            buffer.data = buffer.data.to(config.buffer_dtype)


def forward(module: nn.Module, config: Any, ignored: set[str], inputs: tuple,
            kwargs: dict) -> Any:
    """Run `module` with its parameters and floating-point inputs in `param_dtype`."""
    dtype = config.param_dtype
    if dtype is None:
        return module(*inputs, **kwargs)
    # A differentiable cast: the gradient reaches the full-precision parameter upcast.
    low = {name: p.to(dtype) for name, p in module.named_parameters()
           if name not in ignored and p.is_floating_point() and p.dtype != dtype}
    return torch.func.functional_call(module, low, cast_floats(inputs, dtype),
                                      cast_floats(kwargs, dtype))


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating-point tensor inside (tuples, lists, dicts) cast to `dtype`."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype
                       else t)


@dataclass
class HookState:
    process_group: dist.ProcessGroup
    reduce_dtype: torch.dtype


def mixed_precision_hook(state: HookState, bucket: Any) -> torch.futures.Future:
    """Sum the bucket in `reduce_dtype`, then divide by the group size (torch's order); the
    reducer copies the result back into the full-precision gradients."""
    low = bucket.buffer().to(state.reduce_dtype)  # a copy unless it is already that dtype
    size = state.process_group.size()
    work = collectives.all_reduce(low, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(size))
