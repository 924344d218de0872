"""This process's place in the job once the process group is up: `Runtime`, and the helpers
that read it (`get_runtime`, `get_rank`, `get_world_size`), plus the exit grace every process
that communicates needs. Starting and ending the group is `ringtrain.launch.process_group`
(`ringtrain.init_distributed()`); this module imports nothing of ringtrain's above torch's shim.

    python -c "import ringtrain; rt = ringtrain.init_distributed(); print(ringtrain.get_runtime())"
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain.torch_internals import default_store

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class DistributedInitError(RuntimeError):
    """A launch mistake: bad or missing configuration, or a rendezvous that did not complete."""


@dataclass(frozen=True)
class Runtime:
    """Where this process stands once the process group is up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    process_group: dist.ProcessGroup
    store: dist.Store  # the rendezvous key-value store every rank reaches (heartbeats, snapshots)


_runtime: Runtime | None = None  # the default group's facts; helpers below read it


def set_runtime(runtime: Runtime | None) -> None:
    """Record (None: forget) the default group's `Runtime` (`ringtrain.launch.process_group`)."""
    global _runtime
    _runtime = runtime


# How long an exiting process lets communication threads finish releasing their last works.
EXIT_GRACE_S = 0.1
_grace_registered = False


def settle_comm_threads(grace_s: float = EXIT_GRACE_S) -> None:
    """Let gloo's worker threads drop what they still hold while Python can still serve them.

    A gloo worker thread releases its reference to a finished work a moment after the waiter
    was woken. When that reference is the last one to a tensor whose Python object died in the
    meantime (or to Python state captured with the work), the release takes the GIL; once
    interpreter shutdown has begun, taking the GIL ends the thread through a noexcept C++ frame
    and the process dies with SIGABRT ("terminate called without an active exception"), after
    the script has finished. Called from an exit handler, which runs before shutdown begins:
    collect garbage, then sleep with the GIL released so any such release completes now.
    """
    gc.collect()
    time.sleep(grace_s)


def register_exit_grace() -> None:
    """Run `settle_comm_threads` at interpreter exit (once per process, idempotent).

    Registered when ringtrain starts a process group or wraps a module, so that exit handlers
    registered earlier, such as torch's own, run after it.
    """
    global _grace_registered
    if not _grace_registered:
        _grace_registered = True
        atexit.register(settle_comm_threads)


def _group_device(backend: str) -> torch.device:
    """The device of a group someone else started (Ray Train, a script calling torch directly).

    Ray Train tells each worker its device in ACCELERATE_TORCH_DEVICE (for Hugging Face
    Accelerate; "cpu" with use_gpu=False). Otherwise NCCL means the current CUDA device, which
    the launcher set; anything else is the CPU, and no torch.cuda call is made to find that out.
    """
    given = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if given:
        return torch.device(given)
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _require() -> Runtime:
    if _runtime is None:
        if dist.is_available() and dist.is_initialized():  # started by torch directly
            backend = dist.get_backend()
            return Runtime(dist.get_rank(), dist.get_world_size(),
                           int(os.environ.get("LOCAL_RANK", 0)), backend, _group_device(backend),
                           dist.group.WORLD, default_store())

        raise DistributedInitError(
            "the process group is not initialised: call ringtrain.init_distributed() first "
            "(it falls back to a single process when no launcher variables are set)"
        )
    return _runtime


def get_runtime() -> Runtime:
    """The current `Runtime`; raises a clear error before `init_distributed()`."""
    return _require()


def get_rank() -> int:
    return _require().rank


def get_world_size() -> int:
    return _require().world_size
