"""Pipeline parallelism: split a model into stages, schedule micro-batches, run them over p2p.

    partition.py  which layers go to which stage (pure)
    actions.py    what a schedule is made of: Forward, Backward (or its two halves), send/recv
    placement.py  which virtual stage each rank's chunk holds: a loop, or a V (zb-v) (pure)
    schedule.py   GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as lists of actions per rank
    validate.py   runs a schedule on paper: deadlock, message order, timing (pure)
    p2p.py        send/recv of activations, gradients and shapes (torch.distributed)
    memory.py     activation bytes held per micro-batch (measurement)
    backward.py   a backward split in two: input gradient now, weight gradients later
    step.py       what each action does in one training step (state keyed by micro-batch, chunk)
    engine.py     one rank running its actions

The trainer-facing strategy is `ringtrain.strategies.pipeline.PipelineStrategy`;
`ringtrain.grid` lays out dp x pp x tp ranks and their process groups.
"""

from ringtrain.pipeline.engine import PipelineStage, StepStats, split_batch
from ringtrain.pipeline.partition import TiedParameter, balanced_sizes, partition, tied_parameters
from ringtrain.pipeline.placement import Placement
from ringtrain.pipeline.schedule import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    Timing,
    build_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    peak_in_flight,
    simulate,
    validate,
    zb_h1,
    zb_v,
)

__all__ = [
    "Action", "Backward", "BackwardInput", "BackwardWeight", "Forward", "PipelineStage",
    "Placement", "RecvActivation", "RecvGrad", "Schedule", "ScheduleError", "SendActivation",
    "SendGrad", "StepStats", "TiedParameter", "Timing", "balanced_sizes", "build_schedule", "gpipe",
    "interleaved", "one_f_one_b", "partition", "peak_in_flight", "simulate", "split_batch",
    "tied_parameters", "validate", "zb_h1", "zb_v",
]
