"""ringtrain: train PyTorch models across many processes and machines.

    import ringtrain
    rt = ringtrain.init_distributed()   # ringtrain run, torchrun, Slurm, Kubernetes, Ray Train, TorchX, MPI, or one process
    model = ringtrain.DistributedDataParallel(model)
"""

from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.runtime import DistributedInitError, Runtime, get_rank, get_runtime, get_world_size

__all__ = [
    "DistributedInitError",
    "Runtime",
    "destroy_distributed",
    "get_rank",
    "get_runtime",
    "get_world_size",
    "init_distributed",
]

__version__ = "0.1.0"

# Heavier pieces load on first use, so `import ringtrain` stays cheap in every rank.
_LAZY = {
    "DistributedDataParallel": "ringtrain.ddp.distributed",
    "DistributedSampler": "ringtrain.data.sampler",
    "Watchdog": "ringtrain.launch.watchdog",
    "check_replicas": "ringtrain.replicas",
    "ReplicasDivergedError": "ringtrain.replicas",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
