"""ringtrain: train PyTorch models across many processes and machines.

    import ringtrain
    rt = ringtrain.init_distributed()   # ringtrain run, torchrun, Slurm, Kubernetes, Ray Train,
                                        # TorchX, MPI, or one process

    model = ringtrain.DistributedDataParallel(model)

or the whole loop (docs/train.md):

    trainer = ringtrain.Trainer(ringtrain.make_strategy("ddp", runtime=rt), rt, model_fn,
                                train_set, eval_set, loss_fn, ringtrain.TrainerConfig(steps=1000))

The demo model and data are packages of their own (`ringtrain.models`, `ringtrain.data`): a
model never needs ringtrain.
"""

from typing import TYPE_CHECKING

from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.runtime import DistributedInitError, Runtime, get_rank, get_runtime, get_world_size

__all__ = [
    # loaded with the package
    "DistributedInitError",
    "Runtime",
    "destroy_distributed",
    "get_rank",
    "get_runtime",
    "get_world_size",
    "init_distributed",
    # loaded on first use (_LAZY)
    "DistributedDataParallel",
    "DistributedSampler",
    "ReplicasDivergedError",
    "SnapshotManager",
    "StopSignal",
    "Trainer",
    "TrainerConfig",
    "Watchdog",
    "ZeroDataParallel",
    "check_replicas",
    "make_strategy",
]

__version__ = "0.1.0"

# Heavier pieces load on first use, so `import ringtrain` stays cheap in every rank (a worker
# of `ringtrain run` that never touches the trainer does not import it).
# tests/test_public_api.py checks that this table, __all__ and the imports below agree.
_LAZY = {
    "DistributedDataParallel": "ringtrain.ddp.distributed",
    "DistributedSampler": "ringtrain.data.sampler",
    "Watchdog": "ringtrain.launch.watchdog",
    "check_replicas": "ringtrain.replicas",
    "ReplicasDivergedError": "ringtrain.replicas",
    "SnapshotManager": "ringtrain.checkpoint.snapshot",
    "StopSignal": "ringtrain.checkpoint.stop",
    "Trainer": "ringtrain.training.trainer",
    "TrainerConfig": "ringtrain.training.config",
    "make_strategy": "ringtrain.strategies",
    "ZeroDataParallel": "ringtrain.zero.sharded",
}

if TYPE_CHECKING:  # for type checkers and editors; never run
    from ringtrain.checkpoint.snapshot import SnapshotManager
    from ringtrain.checkpoint.stop import StopSignal
    from ringtrain.data.sampler import DistributedSampler
    from ringtrain.ddp.distributed import DistributedDataParallel
    from ringtrain.launch.watchdog import Watchdog
    from ringtrain.replicas import ReplicasDivergedError, check_replicas
    from ringtrain.strategies import make_strategy
    from ringtrain.training.config import TrainerConfig
    from ringtrain.training.trainer import Trainer
    from ringtrain.zero.sharded import ZeroDataParallel


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # found directly next time
        return value
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
