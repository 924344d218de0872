"""Pipeline parallelism: split a model into stages, schedule micro-batches, run them over p2p.

    partition.py  which layers go to which stage (pure)
    schedule.py   GPipe and 1F1B as lists of actions per stage, and their validator (pure)
    p2p.py        send/recv of activations, gradients and shapes (torch.distributed)
    engine.py     one stage running its actions

The trainer-facing strategy is `ringtrain.strategies.pipeline.PipelineStrategy`;
`ringtrain.pipeline.topology` lays out dp x pp ranks and their process groups.
"""

from ringtrain.pipeline.engine import PipelineStage, StepStats, split_batch
from ringtrain.pipeline.partition import TiedParameter, balanced_sizes, partition, tied_parameters
from ringtrain.pipeline.schedule import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    validate,
)

__all__ = [
    "Action", "Backward", "Forward", "PipelineStage", "RecvActivation", "RecvGrad", "Schedule",
    "ScheduleError", "SendActivation", "SendGrad", "StepStats", "TiedParameter", "balanced_sizes",
    "build_schedule", "gpipe", "one_f_one_b", "partition", "peak_in_flight", "split_batch",
    "tied_parameters", "validate",
]
