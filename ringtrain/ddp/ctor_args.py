"""The constructor arguments of `DistributedDataParallel`: checked and resolved as torch's are.

`DistributedDataParallel.__init__` takes every argument torch's takes (torch 2.11 to 2.15, in
torch's positional order) and hands them here: each one is either given torch's meaning or
refused with an error that names it and says why. Nothing is silently ignored:

- `process_group` / `device_mesh`: the group to average over (`process_group_from`).
- `broadcast_buffers` (deprecated in torch 2.13) / `forward_sync_buffers`: whether buffers follow
  rank 0 before each forward that follows a synced one and at construction, with torch's
  FutureWarnings
  (`buffer_sync_flags`).
- `bucket_cap_mb` / `bucket_cap_mb_list`: the bucket sizes (`bucket_caps`).
- `check_reduction`, `batched_grad_copy`, `lazy_bucket_allocation`: no effect on the results;
  each says so when set (`warn_no_effect`).
- `device_ids` / `output_device` and the parameters' devices (`check_devices`, `check_params`);
  the devices the group's backend moves (`check_backend_devices`, ZeroDataParallel's too).
- `delay_all_reduce_named_params` / `param_to_hook_all_reduce`: `check_delay_args` here, the
  all-reduce in `delayed.py`; `mixed_precision`: `mixed_precision.py`.

The errors subclass what torch raises for the same mistake (`DDPArgumentError` is a ValueError,
as ringtrain's errors were, and a RuntimeError, as torch's are). Tests:
`.venv/bin/pytest -q tests/test_ddp_ctor_args.py`.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.ddp.buckets import DEFAULT_BUCKET_CAP_MB
from ringtrain.ddp.ignored import IGNORE_ATTR

# torch 2.13 added `forward_sync_buffers` and deprecated `broadcast_buffers`; on an older torch
# the old name is the only one and says nothing, so a drop-in says nothing there either.
BROADCAST_BUFFERS_DEPRECATED = "forward_sync_buffers" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel.__init__).parameters

_MB = 1024 * 1024


class DDPArgumentError(ValueError, RuntimeError):
    """A DistributedDataParallel argument torch refuses with RuntimeError, or one ringtrain
    cannot give torch's meaning to; a ValueError too, as ringtrain's argument errors are."""


def process_group_from(process_group: dist.ProcessGroup | None,
                       device_mesh: Any) -> dist.ProcessGroup:
    """The group to average over: `process_group`, the 1-D `device_mesh`'s, or the world's."""
    if process_group is not None and device_mesh is not None:
        raise DDPArgumentError("Cannot specify both process_group and device_mesh arguments. "
                               "Pass one: device_mesh=mesh uses mesh.get_group(0)")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise DDPArgumentError(
                f"Only 1D device mesh is supported, but got {device_mesh} (ndim="
                f"{device_mesh.ndim}): pass the data-parallel dimension, mesh['dp']")
        return device_mesh.get_group(0)
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        raise DDPArgumentError(
            "DistributedDataParallel needs an initialised process group: call "
            "ringtrain.init_distributed() (or torch.distributed.init_process_group) first, "
            "or pass process_group="
        )
    return dist.group.WORLD


def buffer_sync_flags(broadcast_buffers: bool | None,
                      forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers before each forward, sync them at construction), as torch 2.13+ decides.

    `broadcast_buffers` is torch 2.13's deprecated name: it warns there (FutureWarning, torch's
    text; not on a torch without `forward_sync_buffers`) and, unlike `forward_sync_buffers`,
    False also leaves buffers out of the construction sync.
    """
    if broadcast_buffers is not None and BROADCAST_BUFFERS_DEPRECATED:
        if forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
                "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
                "rank-local buffers), keep using `broadcast_buffers=False` until "
                "`init_sync_buffers` is available.",
                FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    sync = True if broadcast_buffers is None else bool(broadcast_buffers)
    return sync, sync


def warn_no_effect(check_reduction: bool, batched_grad_copy: bool,
                   lazy_bucket_allocation: bool) -> None:
    """Arguments that change no result: torch's deprecation, or one warning that says so."""
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)
    for name, value, why in (
        ("batched_grad_copy", batched_grad_copy,
         "it batches torch's per-parameter copies into the bucket; ringtrain copies each "
         "gradient while it is hot and reduces large ones in place (ringtrain/ddp/buckets.py)"),
        ("lazy_bucket_allocation", lazy_bucket_allocation,
         "ringtrain allocates its buckets once, at construction, and keeps them"),
    ):
        if value:
            warnings.warn(f"{name}=True changes no result and is not implemented by ringtrain's "
                          f"DistributedDataParallel: {why}. Leave it out to silence this.",
                          UserWarning, stacklevel=3)


def bucket_caps(bucket_cap_mb: float | None,
                bucket_cap_mb_list: Sequence[float] | None) -> tuple[int, list[int]]:
    """(bucket_bytes_cap, per-bucket caps in bytes or []), as torch's `_BucketCapacityConfig`.

    With `bucket_cap_mb_list`, bucket k (in reduction order) closes at list[k] MiB, the last
    entry repeating, and `bucket_cap_mb` is not used; `bucket_bytes_cap` is the largest entry.
    """
    if bucket_cap_mb_list:
        bad = [c for c in bucket_cap_mb_list if not c > 0]
        if bad:
            raise ValueError(f"bucket_cap_mb_list={list(bucket_cap_mb_list)}: every size must be "
                             f"positive (MiB), got {bad}")
        caps = [int(c * _MB) for c in bucket_cap_mb_list]
        return max(caps), caps
    cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb}: it must be positive (default 25)")
    return int(cap_mb * _MB), []


def check_delay_args(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any) -> None:
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be "
                         "set at the same time: the delayed gradients are averaged when "
                         "param_to_hook_all_reduce's gradient is computed")


# The device types each built-in backend moves (torch.distributed's backend table). A tensor on
# another fails in its first collective with "No backend type associated with device type cpu",
# which names neither the tensor nor the fix: a model left on the CPU with NCCL, the most common
# DDP mistake on a GPU box (pytorch#109103: a buffer on the CPU).
BACKEND_DEVICES = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "xccl": ("xpu",)}


def backend_name(group: dist.ProcessGroup) -> str:
    """torch's name of `group`'s backend ("gloo", "nccl", "cpu:gloo,cuda:nccl")."""
    try:
        return str(dist.get_backend(group))
    except ValueError:  # a group made outside torch's registry (a live generation's): one backend
        return group.name()


def backend_devices(group: dist.ProcessGroup) -> dict[str, str] | None:
    """{device type: backend} of `group`; None for a backend not in BACKEND_DEVICES (mpi, ucc,
    a plugin's): its devices are its own business."""
    name = backend_name(group)
    if ":" in name:  # "cpu:gloo,cuda:nccl", init_process_group()'s default on a GPU box
        return dict(pair.split(":", 1) for pair in name.split(","))
    return {kind: name for kind in BACKEND_DEVICES[name]} if name in BACKEND_DEVICES else None


def check_backend_devices(named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                          who: str = "DistributedDataParallel") -> None:
    """Refuse, before any collective, tensors `who` communicates on a device `group`'s backend
    cannot move. Only with more than one rank: one rank sends nothing."""
    served = backend_devices(group) if group.size() > 1 else None
    if served is None:
        return
    wrong = [(n, t) for n, t in named if t.device.type not in served]
    if not wrong:
        return
    name, tensor = wrong[0]
    backend = backend_name(group)
    others = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    raise DDPArgumentError(
        f"{who}: {name}{others} is on {tensor.device}, but the process group's backend "
        f"{backend!r} moves only {' and '.join(sorted(served))} tensors (torch would fail in the "
        f"first collective: 'No backend type associated with device type "
        f"{tensor.device.type}'): move the module to this rank's device first "
        "(model.to(rt.device), rt = ringtrain.init_distributed(); its buffers too), or start the "
        f"group with a backend that moves {tensor.device.type} tensors (for the CPU, gloo: "
        "RINGTRAIN_BACKEND=gloo, or dist.init_process_group('gloo'))")


def check_params(named: Sequence[tuple[str, torch.Tensor]], module: torch.nn.Module) -> None:
    """The parameters DDP reduces: some exist, none uninitialised, none with a sparse gradient."""
    if not named:
        ignored = getattr(module, IGNORE_ATTR, ())
        outside = " outside the ignored ones" if ignored else ""
        raise DDPArgumentError(
            f"DistributedDataParallel is not needed when a module has no parameter that "
            f"requires a gradient ({type(module).__name__} has none{outside}); "
            "use the module as is")
    lazy = [n for n, p in named if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    if lazy:
        raise DDPArgumentError(
            f"Modules with uninitialized parameters can't be used with `DistributedDataParallel` "
            f"({lazy}). Run a dummy forward pass to correctly initialize the modules")
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True:
            raise ValueError(
                f"{name or type(module).__name__} ({type(sub).__name__}) has sparse=True; "
                "ringtrain's DistributedDataParallel reduces dense gradients only: build it "
                "with sparse=False"
            )
    if any(_is_dtensor(p) for _, p in named):
        raise DDPArgumentError(
            "the module has DTensor parameters (tensor parallelism on a device mesh); "
            "ringtrain's DistributedDataParallel averages plain tensors: wrap it with torch's "
            "DistributedDataParallel(module, device_mesh=mesh['dp'])")


def _is_dtensor(t: torch.Tensor) -> bool:
    # Where torch.distributed.tensor was never imported there is no DTensor to find.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_devices(devices: set[torch.device], device_ids: Sequence[int | torch.device] | None,
                  output_device: int | torch.device | None) -> tuple[list[int] | None, Any]:
    """(device_ids, output_device) as DDP keeps them; ValueError where torch raises one."""
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {sorted(kinds)}: move the module to one device "
            "type first")
    if device_ids is None or len(device_ids) == 0:
        if output_device is not None and (len(devices) > 1
                                          or next(iter(devices)).type == "cpu"):
            raise ValueError(
                f"output_device={output_device!r} only works with single-device CUDA modules; "
                f"this module's parameters are on {sorted(map(str, devices))}: pass "
                "output_device=None"
            )
        return None, output_device
    if len(devices) > 1 or next(iter(devices)).type == "cpu":
        raise ValueError(
            f"device_ids={list(device_ids)} only works with a module on one CUDA device; this "
            f"module's parameters are on {sorted(map(str, devices))}: pass device_ids=None"
        )
    if len(device_ids) != 1:
        raise ValueError(
            f"device_ids={list(device_ids)}: one process drives one device, so device_ids can "
            "only be None or contain a single element"
        )
    index = (torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int)
             else torch.device(device_ids[0]))
    device = next(iter(devices))
    if index != device:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}; "
            f"move the module there first (module.to({str(index)!r})) or pass "
            f"device_ids=[{device.index}]"
        )
    return [device.index], device.index if output_device is None else output_device


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` (forward's inputs: tensors in tuples, namedtuples, lists, dicts) with `fn` applied
    to every tensor inside; anything else is kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """`obj` with its tensors moved to `device` (a CUDA module's device_ids)."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


def check_default_group(process_group: dist.ProcessGroup) -> None:
    """Pickling drops the group and unpickling takes the world's: refuse any other (as torch)."""
    if not (dist.is_initialized() and process_group == dist.group.WORLD):
        raise DDPArgumentError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default process "
            "group. That is, when you have called init_process_group and have not passed "
            "process_group argument to DDP constructor. To save this model, save "
            "ddp.module (or its state_dict()) instead")
