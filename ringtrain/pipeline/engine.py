"""Run a pipeline schedule on one stage: micro-batches, dry run, forward/backward, p2p.

`PipelineStage` holds one stage's module and its neighbours' global ranks. `train_step(x, y,
microbatches)` splits the batch, learns the boundary shapes by a dry run the first time it sees
an input shape, validates the schedule (a deadlock is an error before anything is sent), then
walks this stage's actions. The loss (last stage) is scaled by 1/M, so the accumulated
gradients equal those of the full batch's mean loss.

    .venv/bin/pytest -q tests/test_pipeline.py
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.pipeline import p2p
from ringtrain.pipeline.schedule import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
    build_schedule,
    validate,
)
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


class _ActivationMeter:
    """Counts bytes of tensors autograd saves for backward, per micro-batch, to report the
    peak held at once. A tensor saved twice (a ReLU output is also the next Linear's input)
    counts once; parameters (and views of them, such as a transposed weight) not at all.
    Views count their own bytes, not their base's: a micro-batch is a view of the batch."""

    def __init__(self, module: nn.Module):
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.per_mb: dict[int, dict[tuple, int]] = {}
        self.live = self.peak = 0

    def add(self, mb: int, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self.param_storages:
            return
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        held = self.per_mb.setdefault(mb, {})
        if key not in held:
            held[key] = t.numel() * t.element_size()
            self.live += held[key]
            self.peak = max(self.peak, self.live)

    @contextlib.contextmanager
    def saving(self, mb: int):
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(mb, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, mb: int) -> None:
        self.live -= sum(self.per_mb.pop(mb, {}).values())


def split_batch(t: torch.Tensor, microbatches: int, at_least: int = 1) -> list[torch.Tensor]:
    """`t` cut along dim 0 into `microbatches` equal parts; a clear error when it does not divide.

    Args:
        at_least: the fewest micro-batches allowed (pp), only to suggest valid choices.
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


@dataclass(frozen=True)
class _Boundary:
    """Shape and dtype of one micro-batch's input and output of this stage (from the dry run;
    no output on the last stage)."""

    in_shape: torch.Size
    in_dtype: torch.dtype
    out_shape: torch.Size | None
    out_dtype: torch.dtype | None


class _Receives:
    """This stage's receives, each posted one turn ahead on its channel (activations from the
    previous stage, gradients from the next), so that the transfer runs while this rank
    computes. Waiting to post until the data is needed costs a scheduler round trip of gloo's
    I/O threads each time, a few ms on a busy CPU. Posting in action-list order keeps the
    channel's message order, which the validator checked."""

    def __init__(self, actions: Sequence[Action], post: Callable[[Action], p2p.PendingRecv]):
        self.post = post
        self.queues: dict[type, deque[Action]] = {
            kind: deque(a for a in actions if isinstance(a, kind))
            for kind in (RecvActivation, RecvGrad)
        }
        self.posted: dict[Action, p2p.PendingRecv] = {}
        for kind in self.queues:
            self._post_next(kind)

    def _post_next(self, kind: type) -> None:
        if self.queues[kind]:
            a = self.queues[kind].popleft()
            self.posted[a] = self.post(a)

    def take(self, a: Action) -> torch.Tensor:
        tensor = self.posted.pop(a).wait()
        self._post_next(type(a))
        return tensor


class PipelineStage:
    """One stage of a pipeline: its module, its place, and how to run a schedule on it.

    Args:
        module: this stage's layers (possibly wrapped in DistributedDataParallel).
        pp_rank, pp: this stage's index and the number of stages.
        pp_ranks: global ranks of the pipeline's stages, in stage order.
        pp_group: the pipeline's process group (p2p goes through it).
        loss_fn: `(output, target) -> mean loss`; used on the last stage.
        schedule: 'gpipe', '1f1b', or a hand-made `Schedule` (one action list per stage).
        no_sync, sync_next_backward: data parallelism over `module` (a DDP wrapper's
            `no_sync` and `reducer.prepare_for_backward`). Every forward runs under
            `no_sync()`, so gradients accumulate locally; `sync_next_backward()` then arms the
            stage's last backward to average everything accumulated. Arming a forward instead
            (DDP's usual way) would not work here: under 1F1B other micro-batches' backwards
            run between a micro-batch's forward and its backward.
        measure_memory: count bytes saved for backward (`StepStats.peak_activation_bytes`).
    """

    def __init__(self, module: nn.Module, *, pp_rank: int, pp: int, pp_ranks: Sequence[int],
                 pp_group: dist.ProcessGroup | None, loss_fn: LossFn | None = None,
                 schedule: str | Schedule = "1f1b",
                 no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
                 sync_next_backward: Callable[[], None] | None = None,
                 measure_memory: bool = False):
        if (no_sync is None) != (sync_next_backward is None):
            raise ValueError("pass both no_sync and sync_next_backward (data parallelism) "
                             "or neither")
        if len(pp_ranks) != pp:
            raise ValueError(f"pp_ranks={list(pp_ranks)} must list one global rank per stage "
                             f"(pp={pp})")
        self.module, self.pp_rank, self.pp = module, pp_rank, pp
        self.pp_ranks, self.pp_group = list(pp_ranks), pp_group
        self.loss_fn, self.schedule = loss_fn, schedule
        self.no_sync, self.sync_next_backward = no_sync, sync_next_backward
        self.measure_memory = measure_memory
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs loss_fn(output, target) -> mean loss")
        first_param = next(module.parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")
        self._shapes: dict[tuple, _Boundary] = {}  # batch shape/dtype -> this stage's boundaries
        self._validated: set[tuple] = set()
        self._batchnorm = [n for n, m in module.named_modules()
                           if isinstance(m, BatchNorm)]
        self._warned_batchnorm = False

    # -- neighbours -------------------------------------------------------------------------
    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.pp_rank + 1]

    # -- dry run ----------------------------------------------------------------------------
    def _dry_run(self, first_input: torch.Tensor) -> _Boundary:
        """Learn this stage's input shape/dtype and pass our output's on: one forward of one
        micro-batch per stage in eval mode, without grad, with the RNG state restored, so the
        real step is unaffected (no dropout draws, no BatchNorm statistics)."""
        if self.is_first:
            shape, dtype = first_input.shape, first_input.dtype
        else:
            shape, dtype = p2p.recv_meta(self.prev_rank, self.pp_group, self.device)
        if self.is_last:
            return _Boundary(shape, dtype, None, None)
        inp = first_input if self.is_first else torch.zeros(shape, dtype=dtype, device=self.device)
        modes = [(m, m.training) for m in self.module.modules()]
        devices = [self.device] if self.device.type != "cpu" else []
        try:
            self.module.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=devices,
                                                        device_type=self.device.type):
                out = self.module(inp)
        finally:
            for m, training in modes:
                m.training = training
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {self.pp_rank} returned a {type(out).__name__}; a stage's output must be "
                "one tensor (it is sent to the next stage). Move the layers that produce tuples "
                "inside one stage, or wrap them so they return a single tensor"
            )
        if not out.is_floating_point():
            raise TypeError(
                f"stage {self.pp_rank} outputs dtype {out.dtype}: a stage boundary carries "
                "activations that need gradients, so it must be floating point. Put the layer "
                "that turns integer inputs into floats (the embedding) in the same stage"
            )
        p2p.send_meta(out, self.next_rank, self.pp_group)
        return _Boundary(shape, dtype, out.shape, out.dtype)

    # -- one training step ------------------------------------------------------------------
    def _actions(self, microbatches: int) -> list[Action]:
        if isinstance(self.schedule, str):
            schedule = build_schedule(self.schedule, self.pp, microbatches)
        else:
            schedule = self.schedule
            if len(schedule) != self.pp:
                raise ValueError(f"the schedule has {len(schedule)} stage lists but pp={self.pp}")
        key = (self.schedule if isinstance(self.schedule, str) else id(self.schedule), microbatches)
        if key not in self._validated:
            validate(schedule, microbatches)  # same on every rank: all raise, none hangs
            self._validated.add(key)
        return schedule[self.pp_rank]

    def _warn_batchnorm(self, batch: int, microbatches: int) -> None:
        if self._batchnorm and microbatches > 1 and not self._warned_batchnorm:
            self._warned_batchnorm = True
            warnings.warn(
                f"stage {self.pp_rank}: BatchNorm layers {self._batchnorm} normalise over "
                f"micro-batches of {batch // microbatches} samples, not the batch of {batch}: "
                "their statistics differ from the unsplit model. Use LayerNorm/GroupNorm, or "
                "fewer, larger micro-batches", stacklevel=3)

    def _post_recv(self, a: Action, bound: _Boundary) -> p2p.PendingRecv:
        if isinstance(a, RecvActivation):
            return p2p.recv_activation(bound.in_shape, bound.in_dtype, self.device,
                                       self.prev_rank, self.pp_group)
        assert bound.out_shape is not None and bound.out_dtype is not None
        return p2p.recv_grad(bound.out_shape, bound.out_dtype, self.device, self.next_rank,
                             self.pp_group)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> StepStats:
        """Forward and backward the batch `(x, y)` as `microbatches` micro-batches.

        Every stage passes the same `(x, y)` (only the first reads `x`, only the last `y`).
        Gradients accumulate in `.grad`; the caller zeroes them and steps the optimizer.
        """
        stats = StepStats(start=time.perf_counter())
        actions = self._actions(microbatches)
        xs, ys = split_batch(x, microbatches, self.pp), split_batch(y, microbatches, self.pp)
        self._warn_batchnorm(x.shape[0], microbatches)
        key = (tuple(x.shape), x.dtype)
        if key not in self._shapes:
            self._shapes[key] = self._dry_run(xs[0])
        bound = self._shapes[key]
        receives = _Receives(actions, lambda a: self._post_recv(a, bound))
        meter = _ActivationMeter(self.module) if self.measure_memory else None
        last_backward = max(i for i, a in enumerate(actions) if isinstance(a, Backward))
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        sends: list[p2p.PendingSend] = []
        losses: list[torch.Tensor] = []
        for i, a in enumerate(actions):
            t0 = time.perf_counter()
            mb = a.mb
            if isinstance(a, RecvActivation):
                inputs[mb] = receives.take(a)
            elif isinstance(a, Forward):
                inp = xs[mb] if self.is_first else inputs[mb]
                with (meter.saving(mb) if meter else contextlib.nullcontext(),
                      self.no_sync() if self.no_sync else contextlib.nullcontext()):
                    out = self.module(inp)
                    if self.is_last:
                        loss = self.loss_fn(out, ys[mb])
                        losses.append(loss.detach())
                        out = loss / microbatches  # equal micro-batches: mean of means = mean
                if meter:
                    meter.add(mb, out)
                if not self.is_last and ((out.shape, out.dtype)
                                         != (bound.out_shape, bound.out_dtype)):
                    raise RuntimeError(
                        f"stage {self.pp_rank}: micro-batch {mb}'s output is {tuple(out.shape)} "
                        f"{out.dtype} but the dry run gave {tuple(bound.out_shape)} "
                        f"{bound.out_dtype}; "
                        "a stage's output shape must depend only on its input's shape")
                outputs[mb] = out
            elif isinstance(a, SendActivation):
                sends.append(p2p.send_activation(outputs[mb], self.next_rank, self.pp_group))
            elif isinstance(a, RecvGrad):
                grads[mb] = receives.take(a)
            elif isinstance(a, Backward):
                if i == last_backward and self.sync_next_backward:
                    self.sync_next_backward()
                torch.autograd.backward(outputs.pop(mb), grads.pop(mb, None))
                if meter:
                    meter.release(mb)
            elif isinstance(a, SendGrad):
                grad = inputs.pop(mb).grad
                if grad is None:
                    raise RuntimeError(
                        f"stage {self.pp_rank} got no gradient for its input of micro-batch {mb}: "
                        "its output does not depend on its input differentiably (detach()?)")
                sends.append(p2p.send_grad(grad, self.prev_rank, self.pp_group))
            t1 = time.perf_counter()
            if isinstance(a, (Forward, Backward)):
                stats.busy_s += t1 - t0
            else:
                stats.wait_s += t1 - t0
            stats.timeline.append((a, t0, t1))
        t0 = time.perf_counter()
        for send in sends:  # validated: each has a matching receive, so this completes
            send.wait()
        stats.end = time.perf_counter()
        stats.wait_s += stats.end - t0
        if meter:
            stats.peak_activation_bytes = meter.peak
        if self.is_last:
            stats.loss_sum = float(torch.stack(losses).sum()) * (x.shape[0] // microbatches)
            stats.count = x.shape[0]
        return stats

    # -- inference --------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, x: torch.Tensor) -> torch.Tensor | None:
        """Run `x` through the whole pipeline in one piece; the output on the last
        stage, else None."""
        if self.is_first:
            inp = x
        else:
            shape, dtype = p2p.recv_meta(self.prev_rank, self.pp_group, self.device)
            inp = p2p.recv_activation(shape, dtype, self.device, self.prev_rank,
                                      self.pp_group).wait()
        out = self.module(inp)
        if self.is_last:
            return out
        p2p.send_meta(out, self.next_rank, self.pp_group)
        p2p.send_activation(out, self.next_rank, self.pp_group).wait()
        return None
