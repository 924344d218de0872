"""The patches under which torch's DDP tests run here: CPU retargeting, and the DDP class swap.

Every patch is applied identically whichever DDP class runs (`torch` or `ringtrain`), so a test
counts only where torch's own DDP passes under the same patches. Two stages:

- `patch_skips()`, once per process before `distributed_test` is imported (its decorators are
  applied at import): `skip_if_lt_x_gpu(x)` becomes torch's own `skip_if_lt_x_gpu(x,
  allow_cpu=True)` (the test runs where no accelerator is visible), and `skip_if_no_gpu` lets
  the test run the same way.
- `install(ddp)`, in each rank before its test: CUDA devices are mapped to the CPU (a
  TorchFunctionMode rewrites `device=` arguments, `.to(...)`, `.cuda()`), the few
  `torch.cuda.*` calls the tests make become no-ops, `init_multigpu_helper` gives rank r the
  device index r, and `DistributedDataParallel` is the chosen class, minus `device_ids` and
  `output_device` (torch's DDP refuses them for a CPU module), under every name a test reaches
  it by: `torch.nn.parallel.DistributedDataParallel` and the test module's own global (bound by
  `from torch.nn.parallel import DistributedDataParallel`); `torch.nn.DistributedDataParallel`
  too where a torch has it (2.13 does not). `torch.nn.parallel.distributed`'s own name stays:
  torch's class refers to itself through it.

RINGTRAIN_TORCH_SUITE_RETARGET=0 runs the tests as shipped: no skip or device patch, only the
class swap (the GPU tests then skip on a CPU machine). The runner keeps CUDA hidden
(CUDA_VISIBLE_DEVICES=""), so allow_cpu's "no accelerator visible" holds on a GPU box too.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

RETARGET_ENV = "RINGTRAIN_TORCH_SUITE_RETARGET"
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
DDP_CHOICES = ("torch", "ringtrain")


def retargeting() -> bool:
    return os.environ.get(RETARGET_ENV, "1") != "0"


def patch_skips() -> None:
    """Let the GPU-only tests run on the CPU; must run before distributed_test is imported."""
    if not retargeting():
        return
    if SUITE_MODULE in sys.modules:
        raise RuntimeError(f"{SUITE_MODULE} was imported before patch_skips(): its decorators "
                           "are already bound; import it through torch_ddp_suite.cases only")
    cd = importlib.import_module("torch.testing._internal.common_distributed")
    if getattr(cd.skip_if_lt_x_gpu, "_retargeted", False):
        return
    shipped = cd.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        return shipped(x, allow_cpu=True)  # torch's own CPU path, for every GPU test

    def skip_if_no_gpu(func):
        return func  # shipped: exit "no CUDA" where no accelerator is visible; run it instead

    skip_if_lt_x_gpu._retargeted = True
    cd.skip_if_lt_x_gpu, cd.skip_if_no_gpu = skip_if_lt_x_gpu, skip_if_no_gpu


# --- in each rank ---------------------------------------------------------------------------
def _cpu(device):
    """A device argument with CUDA (a torch.device, "cuda:N", or a bare index) mapped to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")  # a bare index means a CUDA device in every torch API
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Rewrites device arguments in every torch call while a test runs.

    `Tensor.to(x)` and `Module.to(x)` (through `torch._C._nn._parse_to`) take the device as a
    positional argument, factories as `device=`; `Tensor.cuda()` returns the tensor itself, as
    `.to(device)` does for a tensor already there.
    """

    _POSITIONAL = (torch.Tensor.to, torch._C._nn._parse_to)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func in self._POSITIONAL:
            first = 1 if func is torch.Tensor.to else 0
            args = (*args[:first], *(_cpu(a) for a in args[first:]))
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return func(*args, **kwargs)


class _NoDevice(contextlib.nullcontext):
    """`torch.cuda.device(i)` / `torch.cuda.stream(s)` as a context that does nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _retargeted(base: type) -> type:
    """`base` with device_ids and output_device dropped: the rest passes through by position."""

    class DistributedDataParallel(base):
        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            super().__init__(module, None, None, *args, **kwargs)

    return DistributedDataParallel


def _ddp_class(ddp: str) -> type:
    if ddp == "torch":
        return torch.nn.parallel.distributed.DistributedDataParallel
    if ddp == "ringtrain":
        from ringtrain.ddp import DistributedDataParallel

        return DistributedDataParallel
    raise ValueError(f"ddp={ddp!r}: choose one of {DDP_CHOICES}")


# Module-level, named per class: torch.save / copy.deepcopy of a wrapped model find the class by
# its qualified name. install() fills the one of its rank's DDP choice.
TorchDDPOnCPU: type | None = None
RingtrainDDPOnCPU: type | None = None


def install(ddp: str, world_size: int) -> type:
    """Apply the rank's patches for DDP class `ddp`; return the class the tests will build."""
    suite = sys.modules[SUITE_MODULE]
    cls = _ddp_class(ddp)
    if retargeting():
        cls = _retargeted(cls)
        name = "TorchDDPOnCPU" if ddp == "torch" else "RingtrainDDPOnCPU"
        cls.__name__, cls.__qualname__, cls.__module__ = name, name, __name__
        globals()[name] = cls
        torch.cuda.set_device = lambda device: None
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_device = lambda: 0
        torch.cuda.device_count = lambda: world_size  # one "device" per rank, as on a GPU box
        torch.cuda.device = torch.cuda.stream = _NoDevice
        suite.init_multigpu_helper = lambda world_size, backend: {r: [r] for r in range(world_size)}
        CudaToCpu().__enter__()  # for the rest of this rank's life: it runs one test
    torch.nn.parallel.DistributedDataParallel = cls
    if hasattr(torch.nn, "DistributedDataParallel"):  # torch 2.13 has none; a later one may
        torch.nn.DistributedDataParallel = cls
    suite.DistributedDataParallel = cls
    return cls
