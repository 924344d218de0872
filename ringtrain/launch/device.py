"""Which backend and device each process of a job uses: one rule, asked by `ringtrain train`
before any worker starts and by `init_distributed` in every worker.

    ringtrain train --nproc-per-node 2 --device cpu                  # a GPU box, trained on CPU
    ringtrain train --nproc-per-node 2 --backend gloo --device cuda  # 2 ranks share 1 GPU (testing)
    RINGTRAIN_DEVICE=cpu ringtrain run --nproc-per-node 4 train.py   # the same for any script

The rule, torch's usual default made safe on a box with fewer GPUs than processes:
- device `auto`: CUDA where torch sees a GPU, unless the backend is gloo; else the CPU. So
  `gloo` alone means CPU, and a gloo job that wants CUDA tensors says `--device cuda`.
- backend `auto`: NCCL on CUDA, gloo on the CPU.
- NCCL gives each process of a machine a GPU of its own (local rank i -> cuda:i). More
  processes per machine than GPUs is refused here, naming the counts and the fixes; left to
  NCCL it fails in the first collective with "Duplicate GPU detected".
- gloo with CUDA tensors lets processes share GPUs (local rank i -> cuda:(i mod GPUs)), to test
  multi-process code on a one-GPU box. gloo's send and recv take CPU tensors only, so
  ringtrain's point-to-point traffic goes through host memory there (`ringtrain.staging`).
An argument wins over RINGTRAIN_BACKEND / RINGTRAIN_DEVICE, which win over `auto` (also an
`auto` given as an argument: `--device auto` is the CLI's default, so it leaves the choice open). No
`torch.cuda` call is made when the CPU was asked for. Tests: `pytest -q tests/test_device.py`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ringtrain.runtime import DistributedInitError

BACKEND_ENV, DEVICE_ENV = "RINGTRAIN_BACKEND", "RINGTRAIN_DEVICE"
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's switch: is_available through NVML
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


class PlacementError(DistributedInitError, ValueError):
    """A backend or device this machine cannot give (a usage mistake: exit 2 in the CLI)."""


@dataclass(frozen=True)
class Placement:
    """Where one process runs: its process-group backend and the device of its tensors."""

    backend: str
    device: torch.device


def cuda_device_count() -> int:
    """GPUs torch sees on this machine; 0 without CUDA (this initialises no CUDA context)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launcher_gpu_count() -> int:
    """GPUs as `torch.cuda.device_count` counts them: through NVML where it can, so the CUDA
    driver stays uninitialised in the launcher, whose warm process for the workers is a fork
    of it (`Zygote.forked_here`; a fork of a process that called cuInit cannot use CUDA).
    `is_available` may call cuInit. Session 22 measured on an H200: after device_count a raw
    fork used CUDA. The workers still ask `cuda_device_count`, which also proves the driver
    works, and say so where it does not."""
    return torch.cuda.device_count()


@contextlib.contextmanager
def gpu_checks_through_nvml() -> Iterator[None]:
    """torch's own GPU checks in the launcher answered through NVML, as `launcher_gpu_count`
    counts: torch's `config_from_args` asks `is_available()` (`LaunchConfig`'s NUMA default
    and --nproc-per-node auto/gpu; torch.cuda's in 2.11-2.14, torch.accelerator's in 2.15),
    which calls cuInit unless PYTORCH_NVML_BASED_CUDA_CHECK=1. After cuInit the launcher's
    fork, the job's warm process, cannot use CUDA, so on every GPU box each `ringtrain train`
    job's workers started from a fresh interpreter instead, --device cpu too (found on an
    H200, session 39). The same count either way where NVML answers (else torch falls back
    to the runtime's); the variable is restored after, so the workers get the user's."""
    before = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NVML_CHECK_ENV, None)
        else:
            os.environ[NVML_CHECK_ENV] = before


def _pick(name: str, value: str | None, env: Mapping[str, str], env_name: str,
          allowed: tuple[str, ...]) -> str:
    # "auto" as an argument is no choice: it is `ringtrain train`'s default, and it must not
    # hide RINGTRAIN_DEVICE=cpu (on a GPU box the test suite's CPU tests ran NCCL without this)
    chosen = (value if value != "auto" else None) or env.get(env_name) or "auto"
    if chosen not in allowed:
        # the CLI's choices catch a bad flag first: a value here came from a call or the env
        where = f"{env_name}={chosen!r}" if not value else f"{name}={chosen!r}"
        raise PlacementError(f"{where}: use one of {', '.join(allowed)}")
    return chosen


def choose(backend: str | None = None, device: str | None = None, *, local_rank: int = 0,
           local_world_size: int = 1, env: Mapping[str, str] | None = None,
           gpus: Callable[[], int] | None = None) -> Placement:
    """The backend and device of local rank `local_rank` of `local_world_size` on this machine.

    Args:
        backend: "gloo", "nccl" or "auto"/None (then RINGTRAIN_BACKEND, then the rule above).
        device: "cpu", "cuda" or "auto"/None (then RINGTRAIN_DEVICE, then the rule above).
        local_rank, local_world_size: this process's place among the machine's processes.
        env: the environment to read (default: os.environ).
        gpus: how many GPUs this machine has (default: `cuda_device_count`); asked only where
            the answer matters.

    Raises:
        PlacementError: NCCL on the CPU, CUDA without a GPU, or more NCCL processes per machine
            than GPUs; each names the counts and the fix.
    """
    env = os.environ if env is None else env
    gpus = gpus or cuda_device_count
    backend = _pick("backend", backend, env, BACKEND_ENV, BACKENDS)
    device = _pick("device", device, env, DEVICE_ENV, DEVICES)
    if device == "cpu" and backend == "nccl":
        raise PlacementError("backend nccl needs CUDA tensors but the device asked for is the "
                             "CPU: use --backend gloo (or RINGTRAIN_BACKEND=gloo) for CPU tensors")
    asked_cuda = device == "cuda"  # else NCCL was, to say which in an error
    if device == "auto":  # gloo alone means the CPU, NCCL means CUDA, auto looks
        device = {"gloo": "cpu", "nccl": "cuda"}.get(backend) or ("cuda" if gpus() > 0 else "cpu")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if device == "cpu":
        return Placement(backend, torch.device("cpu"))
    count = gpus()
    if count == 0:
        build = (" (a CPU-only build: GPUs need a CUDA build of torch)" if torch.version.cuda
                 is None else "")
        cpu = ("--device cpu (RINGTRAIN_DEVICE=cpu)" if asked_cuda else
               "--backend gloo (RINGTRAIN_BACKEND=gloo) for the CPU")
        raise PlacementError(f"{'device cuda' if asked_cuda else 'backend nccl'} was asked for "
                             f"but torch {torch.__version__}{build} sees no GPU here: use {cpu}, "
                             "or check CUDA_VISIBLE_DEVICES and the driver (python -c 'import "
                             "torch; print(torch.cuda.is_available())')")
    if backend == "nccl" and local_world_size > count:
        raise PlacementError(
            f"{local_world_size} processes on this machine but {count} GPU"
            f"{'s' if count > 1 else ''}: NCCL needs a GPU per process (it fails with 'Duplicate "
            f"GPU detected' otherwise). Use --nproc-per-node {count}; or, to test multi-process "
            "code on fewer GPUs, --backend gloo --device cuda (RINGTRAIN_BACKEND=gloo "
            "RINGTRAIN_DEVICE=cuda: ranks share a GPU, slower); or --device cpu")
    return Placement(backend, torch.device("cuda", local_rank % count))
