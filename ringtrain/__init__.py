"""ringtrain: train PyTorch models across many processes and machines.

    import ringtrain
    rt = ringtrain.init_distributed()          # torchrun variables, or one process
    model = ringtrain.DistributedDataParallel(model)
"""

from ringtrain.runtime import (
    DistributedInitError,
    Runtime,
    destroy_distributed,
    get_rank,
    get_runtime,
    get_world_size,
    init_distributed,
)

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
