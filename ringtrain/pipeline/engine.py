"""Run a pipeline schedule on one rank: micro-batches, dry run, forward/backward, p2p.

`PipelineStage` holds one rank's stage (or its `v` chunks, for interleaved and zb-v schedules,
placed as `placement.py` says) and its neighbours' global ranks. `train_step(x, y,
microbatches)` splits the batch, learns the boundary shapes by a dry run the first time it sees
an input shape, validates the schedule (a deadlock is an error before anything is sent), then
walks this rank's actions (`step.py` says what each one does). A split backward (zero-bubble
schedules) computes the input gradient first, keeping the gradients at the parameters'
consumers, and at `BackwardWeight` only the weight gradients from there (`backward.py`, as
torch's pipelining `stage_backward_input` / `stage_backward_weight`). The loss (last stage) is
scaled by 1/M, so the accumulated gradients equal those of the full batch's mean loss.

    .venv/bin/pytest -q tests/test_pipeline.py
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.pipeline import p2p
from ringtrain.pipeline.placement import Placement
from ringtrain.pipeline.schedule import (
    COMPUTE,
    Action,
    RecvActivation,
    Schedule,
    build_schedule,
    placement,
    validate,
)
from ringtrain.pipeline.step import Boundary, StepRun
from ringtrain.torch_internals import BatchNorm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepStats:
    """What one `train_step` did on this stage (times from `time.perf_counter`)."""

    loss_sum: float | None = None  # last stage: sum over samples of the per-sample mean loss
    count: int = 0  # samples behind loss_sum (0 off the last stage)
    busy_s: float = 0.0  # forward + backward compute
    wait_s: float = 0.0  # blocked in receives and in the final wait on sends
    start: float = 0.0
    end: float = 0.0
    peak_activation_bytes: int = 0  # most bytes saved for backward at once (measure_memory)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


def split_batch(t: torch.Tensor, microbatches: int, at_least: int = 1) -> list[torch.Tensor]:
    """`t` cut along dim 0 into `microbatches` equal parts; a clear error when it does not divide.

    Args:
        at_least: the fewest micro-batches to suggest among the valid choices.
    """
    size = t.shape[0]
    if microbatches < 1 or size % microbatches != 0:
        fits = [m for m in range(max(1, at_least), size + 1) if size % m == 0]
        choices = f"use --microbatches in {fits} or " if fits else "use "
        raise ValueError(
            f"a batch of {size} samples cannot be split into microbatches={microbatches} equal "
            f"micro-batches; {choices}a batch size that is a multiple of {microbatches}"
        )
    return list(t.chunk(microbatches))


Hook = Callable[[], contextlib.AbstractContextManager]  # a DDP wrapper's no_sync
Arm = Callable[[], None]  # its reducer's prepare_for_backward


class PipelineStage:
    """One rank of a pipeline: its stage (or chunks), its place, and how to run a schedule on it.

    Args:
        module: this rank's layers (possibly wrapped in DistributedDataParallel), or, for an
            interleaved or zb-v schedule, its `v` chunks in order (`placement.py`: interleaved
            chunk c is virtual stage c*pp + pp_rank; zb-v's are pp_rank and 2*pp-1-pp_rank).
        pp_rank, pp: this rank's index and the number of ranks in the pipeline.
        pp_ranks: global ranks of the pipeline's stages, in stage order.
        pp_group: the pipeline's process group (p2p goes through it).
        grad_group: the group the gradients of stage inputs travel back on (default:
            pp_group). On gloo pass a second group of the same ranks
            (`ringtrain.grid.create_pp_grad_groups`): on one group a gradient going back and an
            activation going forward share one TCP connection per pair of ranks, and a 1F1B
            step waited on it (a 2-stage GPT of width 32, M = 8: 12.1 -> 5.7 ms median).
        loss_fn: `(output, target) -> mean loss`; used on the last stage.
        schedule: a name in `SCHEDULES` ('1f1b', 'gpipe', 'interleaved', 'zb-h1', 'zb-v'), or
            a hand-made `Schedule` (one action list per rank).
        v_shape: a hand-made schedule's chunks sit in a V (as zb-v's), not a loop; a named
            schedule knows its own.
        no_sync, sync_next_backward: data parallelism over `module` (a DDP wrapper's
            `no_sync` and `reducer.prepare_for_backward`; one of each per chunk). Every forward
            runs under `no_sync()`, so gradients accumulate locally; `sync_next_backward()` then
            arms the chunk's last weight-gradient pass to average everything accumulated. Arming
            a forward instead (DDP's usual way) would not work here: under 1F1B other
            micro-batches' backwards run between a micro-batch's forward and its backward.
        measure_memory: count bytes saved for backward (`StepStats.peak_activation_bytes`).
    """

    def __init__(self, module: nn.Module | Sequence[nn.Module], *, pp_rank: int, pp: int,
                 pp_ranks: Sequence[int], pp_group: dist.ProcessGroup | None,
                 grad_group: dist.ProcessGroup | None = None, loss_fn: LossFn | None = None,
                 schedule: str | Schedule = "1f1b",
                 no_sync: Hook | Sequence[Hook] | None = None,
                 sync_next_backward: Arm | Sequence[Arm] | None = None,
                 measure_memory: bool = False, v_shape: bool = False):
        if (no_sync is None) != (sync_next_backward is None):
            raise ValueError("pass both no_sync and sync_next_backward (data parallelism) "
                             "or neither")
        if len(pp_ranks) != pp:
            raise ValueError(f"pp_ranks={list(pp_ranks)} must list one global rank per stage "
                             f"(pp={pp})")
        self.chunks = [module] if isinstance(module, nn.Module) else list(module)
        self.v = len(self.chunks)
        self.module = self.chunks[0] if self.v == 1 else nn.ModuleList(self.chunks)
        self.no_sync = _per_chunk(no_sync, self.v, "no_sync")
        self.sync_next_backward = _per_chunk(sync_next_backward, self.v, "sync_next_backward")
        self.pp_rank, self.pp = pp_rank, pp
        self.placement = (placement(schedule, pp, self.v) if isinstance(schedule, str)
                          else Placement(pp, self.v, v_shape))
        self.pp_ranks, self.pp_group = list(pp_ranks), pp_group
        self.grad_group = pp_group if grad_group is None else grad_group
        self.loss_fn, self.schedule = loss_fn, schedule
        self.measure_memory = measure_memory
        # Which rank holds the first / last virtual stage (zb-v: rank 0 holds both).
        self.is_first = self.placement.where(0)[0] == pp_rank
        self.is_last = self.placement.where(self.placement.stages - 1)[0] == pp_rank
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs loss_fn(output, target) -> mean loss")
        first_param = next(self.module.parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")
        self._shapes: dict[tuple, list[Boundary]] = {}  # batch shape/dtype -> per chunk
        self._proven: dict[tuple, list[Action]] = {}  # (schedule, M) -> this rank's, validated
        self._batchnorm = [n for n, m in self.module.named_modules()
                           if isinstance(m, BatchNorm)]
        self._warned_batchnorm = False

    # -- neighbours -------------------------------------------------------------------------
    def peer(self, chunk: int, step: int) -> int:
        """Global rank of the stage `step` (+1 next, -1 previous) away from `chunk`'s (an
        interleaved rank 0's chunk c > 0 follows the last rank)."""
        other = self.placement.neighbour(self.pp_rank, chunk, step)
        assert other is not None, "the validated schedule sends nothing past the ends"
        return self.pp_ranks[other[0]]

    def local(self, chunk: int, step: int) -> int | None:
        """This rank's chunk that holds the stage `step` away, if one does (a V's bottom)."""
        return self.placement.local(self.pp_rank, chunk, step)

    def chunk_ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether `chunk` of this rank is the pipeline's first / last virtual stage."""
        k = self.placement.stage(self.pp_rank, chunk)
        return k == 0, k == self.placement.stages - 1

    # -- dry run ----------------------------------------------------------------------------
    def _dry_run(self, first_input: torch.Tensor) -> list[Boundary]:
        """Learn each chunk's input shape/dtype and pass its output's on: one forward of one
        micro-batch per chunk in eval mode, without grad, with the RNG state restored, so the
        real step is unaffected (no dropout draws, no BatchNorm statistics). Chunks go in
        order, which is the pipeline's virtual-stage order on every rank: no cycle. A chunk
        whose neighbour stage is its own rank's (a V's bottom) hands the shape over locally."""
        bounds: list[Boundary] = []
        for c, chunk in enumerate(self.chunks):
            first, last = self.chunk_ends(c)
            prev = self.local(c, -1)
            if first:
                shape, dtype = first_input.shape, first_input.dtype
            elif prev is not None:
                shape, dtype = bounds[prev].out_shape, bounds[prev].out_dtype
            else:
                shape, dtype = p2p.recv_meta(self.peer(c, -1), self.pp_group, self.device)
            if last:
                bounds.append(Boundary(shape, dtype, None, None))
                continue
            inp = first_input if first else torch.zeros(shape, dtype=dtype, device=self.device)
            modes = [(m, m.training) for m in chunk.modules()]
            devices = [self.device] if self.device.type != "cpu" else []
            try:
                chunk.eval()
                with torch.no_grad(), torch.random.fork_rng(devices=devices,
                                                            device_type=self.device.type):
                    out = chunk(inp)
            finally:
                for m, training in modes:
                    m.training = training
            where = f"stage {self.pp_rank}" + (f" chunk {c}" if self.v > 1 else "")
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"{where} returned a {type(out).__name__}; a stage's output must be "
                    "one tensor (it is sent to the next stage). Move the layers that produce "
                    "tuples inside one stage, or wrap them so they return a single tensor")
            if not out.is_floating_point():
                raise TypeError(
                    f"{where} outputs dtype {out.dtype}: a stage boundary carries "
                    "activations that need gradients, so it must be floating point. Put the "
                    "layer that turns integer inputs into floats (the embedding) in the same stage")
            if self.local(c, 1) is None:
                p2p.send_meta(out, self.peer(c, 1), self.pp_group)
            bounds.append(Boundary(shape, dtype, out.shape, out.dtype))
        return bounds

    # -- one training step ------------------------------------------------------------------
    def _actions(self, microbatches: int) -> list[Action]:
        key = (self.schedule if isinstance(self.schedule, str) else id(self.schedule), microbatches)
        if key in self._proven:
            return self._proven[key]
        if isinstance(self.schedule, str):
            schedule = build_schedule(self.schedule, self.pp, microbatches, self.v)
        else:
            schedule = self.schedule
            if len(schedule) != self.pp:
                raise ValueError(f"the schedule has {len(schedule)} stage lists but pp={self.pp}")
        validate(schedule, microbatches, self.v, self.placement.v_shape)  # all raise, none hangs
        # Built and proven once per M: building alone took 0.4-1.4 ms a step at pp 8, M 32.
        self._proven[key] = schedule[self.pp_rank]
        return self._proven[key]

    def _warn_batchnorm(self, batch: int, microbatches: int) -> None:
        if self._batchnorm and microbatches > 1 and not self._warned_batchnorm:
            self._warned_batchnorm = True
            warnings.warn(
                f"stage {self.pp_rank}: BatchNorm layers {self._batchnorm} normalise over "
                f"micro-batches of {batch // microbatches} samples, not the batch of {batch}: "
                "their statistics differ from the unsplit model. Use LayerNorm/GroupNorm, or "
                "fewer, larger micro-batches", stacklevel=3)

    def post_recv(self, a: Action, bounds: list[Boundary]) -> p2p.PendingRecv:
        bound = bounds[a.chunk]
        if isinstance(a, RecvActivation):
            return p2p.recv_activation(bound.in_shape, bound.in_dtype, self.device,
                                       self.peer(a.chunk, -1), self.pp_group)
        assert bound.out_shape is not None and bound.out_dtype is not None
        return p2p.recv_grad(bound.out_shape, bound.out_dtype, self.device,
                             self.peer(a.chunk, 1), self.grad_group)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> StepStats:
        """Forward and backward the batch `(x, y)` as `microbatches` micro-batches.

        Every stage passes the same `(x, y)` (only the first reads `x`, only the last `y`).
        Gradients accumulate in `.grad`; the caller zeroes them and steps the optimizer.
        """
        stats = StepStats(start=time.perf_counter())
        actions = self._actions(microbatches)
        xs, ys = split_batch(x, microbatches), split_batch(y, microbatches)
        self._warn_batchnorm(x.shape[0], microbatches)
        key = (tuple(x.shape), x.dtype)
        if key not in self._shapes:
            self._shapes[key] = self._dry_run(xs[0])
        run = StepRun(self, actions, xs, ys, self._shapes[key], microbatches)
        for a in actions:
            t0 = time.perf_counter()
            run.do(a)
            t1 = time.perf_counter()
            if isinstance(a, COMPUTE):
                stats.busy_s += t1 - t0
            else:
                stats.wait_s += t1 - t0
            stats.timeline.append((a, t0, t1))
        t0 = time.perf_counter()
        for send in run.sends:  # validated: each has a matching receive, so this completes
            send.wait()
        stats.end = time.perf_counter()
        stats.wait_s += stats.end - t0
        if run.meter:
            stats.peak_activation_bytes = run.meter.peak
        if self.is_last:
            stats.loss_sum = float(torch.stack(run.losses).sum()) * (x.shape[0] // microbatches)
            stats.count = x.shape[0]
        return stats

    # -- inference --------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, x: torch.Tensor) -> torch.Tensor | None:
        """Run `x` through the whole pipeline in one piece; the output on the last
        stage, else None."""
        out = None
        for c, chunk in enumerate(self.chunks):
            first, last = self.chunk_ends(c)
            if first:
                inp = x
            elif self.local(c, -1) is not None:
                inp = out  # a V's bottom: the previous chunk's output, on this rank
            else:
                shape, dtype = p2p.recv_meta(self.peer(c, -1), self.pp_group, self.device)
                inp = p2p.recv_activation(shape, dtype, self.device, self.peer(c, -1),
                                          self.pp_group).wait()
            out = chunk(inp)
            if not last and self.local(c, 1) is None:
                p2p.send_meta(out, self.peer(c, 1), self.pp_group)
                p2p.send_activation(out, self.peer(c, 1), self.pp_group).wait()
                out = None
        return out



def _per_chunk(hooks, v: int, name: str) -> list | None:
    """One data-parallel hook per chunk (a single one when there is one chunk)."""
    if hooks is None:
        return None
    hooks = [hooks] if callable(hooks) else list(hooks)
    if len(hooks) != v:
        raise ValueError(f"{name}: {len(hooks)} hooks for {v} chunks; pass one per chunk")
    return hooks
