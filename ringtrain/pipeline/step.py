"""One `PipelineStage.train_step` in the making: what each action reads and leaves behind.

`StepRun.do(action)` runs one action of this rank's list (`engine.py` times it): receives are
posted ahead (`Receives`), forwards keep their output for the backward, a split backward keeps
the graph between its input-gradient and weight-gradient halves.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.pipeline import p2p
from ringtrain.pipeline.backward import WeightPass, backward_input
from ringtrain.pipeline.memory import ActivationMeter
from ringtrain.pipeline.schedule import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)


class Stage(Protocol):
    """What a step reads of its `engine.PipelineStage` (named here, not imported: the engine
    imports this module)."""

    pp_rank: int
    v: int
    chunks: list[nn.Module]
    module: nn.Module
    pp_group: dist.ProcessGroup | None
    grad_group: dist.ProcessGroup | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    no_sync: list[Callable[[], contextlib.AbstractContextManager]] | None
    sync_next_backward: list[Callable[[], None]] | None
    measure_memory: bool

    def peer(self, chunk: int, step: int) -> int: ...

    def local(self, chunk: int, step: int) -> int | None: ...

    def chunk_ends(self, chunk: int) -> tuple[bool, bool]: ...

    def post_recv(self, a: Action, bounds: list[Boundary]) -> p2p.PendingRecv: ...


@dataclass(frozen=True)
class Boundary:
    """Shape and dtype of one micro-batch's input and output of this stage (from the dry run;
    no output on the last stage)."""

    in_shape: torch.Size
    in_dtype: torch.dtype
    out_shape: torch.Size | None
    out_dtype: torch.dtype | None


class Receives:
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


class StepRun:
    """The state of one `train_step` on one rank: what each action reads and leaves behind,
    keyed by (micro-batch, chunk)."""

    def __init__(self, stage: Stage, actions: list[Action], xs: list[torch.Tensor],
                 ys: list[torch.Tensor], bounds: list[Boundary], microbatches: int):
        self.stage, self.xs, self.ys, self.bounds = stage, xs, ys, bounds
        self.microbatches = microbatches
        self.receives = Receives(actions, lambda a: stage.post_recv(a, bounds))
        self.meter = ActivationMeter(stage.module) if stage.measure_memory else None
        # Each chunk's last weight-gradient pass: where data parallelism is armed.
        self.arm: set[int] = set()
        for c in range(stage.v):
            weights = [i for i, a in enumerate(actions)
                       if a.chunk == c and isinstance(a, (Backward, BackwardWeight))]
            self.arm.add(weights[-1])
        self.index = 0
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_passes: dict[tuple[int, int], WeightPass] = {}
        self.sends: list[p2p.PendingSend] = []
        self.losses: list[torch.Tensor] = []

    def do(self, a: Action) -> None:
        st, key, c = self.stage, (a.mb, a.chunk), a.chunk
        first, last = st.chunk_ends(c)
        if isinstance(a, (RecvActivation, RecvGrad)):
            store = self.inputs if isinstance(a, RecvActivation) else self.grads
            store[key] = self.receives.take(a)
        elif isinstance(a, Forward):
            self._forward(a, first, last)
        elif isinstance(a, SendActivation):
            self.sends.append(p2p.send_activation(self.outputs[key], st.peer(c, 1), st.pp_group))
        elif isinstance(a, (Backward, BackwardWeight)):
            if self.index in self.arm and st.sync_next_backward:
                st.sync_next_backward[c]()
            self._local_grad(a)
            weight_pass = self.weight_passes.pop(key, None)
            if weight_pass is not None:
                weight_pass.run()
            else:  # a whole backward, or the first stage's (its input needs no gradient)
                out, grad = self.outputs.pop(key), self.grads.pop(key, None)
                torch.autograd.backward(out, grad)
            if self.meter:
                self.meter.release(key)
        elif isinstance(a, BackwardInput):
            self._local_grad(a)
            # d loss / d input now (the previous stage waits on it), keeping the gradients at
            # the parameters' consumers for the weight pass (`backward.py`). The first virtual
            # stage's input needs no gradient: its whole backward waits for BackwardWeight.
            if not first:
                params = [p for p in st.chunks[c].parameters() if p.requires_grad]
                self.input_grads[key], self.weight_passes[key] = backward_input(
                    self.outputs.pop(key), self.grads.pop(key, None), self.inputs[key], params)
        elif isinstance(a, SendGrad):
            self._send_grad(a)
        self.index += 1

    def _local_grad(self, a: Action) -> None:
        """At a V's bottom the next stage is this rank's own chunk: its input gradient is this
        chunk's output gradient, with no message (the validator checked it ran first)."""
        nxt = self.stage.local(a.chunk, 1)
        if nxt is not None and not isinstance(a, BackwardWeight):
            self.grads[(a.mb, a.chunk)] = self._input_grad((a.mb, nxt))

    def _forward(self, a: Forward, first: bool, last: bool) -> None:
        st, key = self.stage, (a.mb, a.chunk)
        prev = st.local(a.chunk, -1)
        if prev is not None:  # a V's bottom: the previous stage's output, on this rank
            self.inputs[key] = self.outputs[(a.mb, prev)].detach().requires_grad_()
        inp = self.xs[a.mb] if first else self.inputs[key]
        with (self.meter.saving(key) if self.meter else contextlib.nullcontext(),
              st.no_sync[a.chunk]() if st.no_sync else contextlib.nullcontext()):
            out = st.chunks[a.chunk](inp)
            if last:
                loss = st.loss_fn(out, self.ys[a.mb])
                self.losses.append(loss.detach())
                out = loss / self.microbatches  # equal micro-batches: mean of means = mean
        if self.meter:
            self.meter.add(key, out)
        bound = self.bounds[a.chunk]
        if not last and (out.shape, out.dtype) != (bound.out_shape, bound.out_dtype):
            raise RuntimeError(
                f"stage {st.pp_rank}: micro-batch {a.mb}'s output is {tuple(out.shape)} "
                f"{out.dtype} but the dry run gave {tuple(bound.out_shape)} {bound.out_dtype}; "
                "a stage's output shape must depend only on its input's shape")
        self.outputs[key] = out

    def _input_grad(self, key: tuple[int, int]) -> torch.Tensor:
        """d loss / d input of (micro-batch, chunk), computed by its backward; done with it."""
        inp = self.inputs.pop(key)
        grad = self.input_grads.pop(key, None)
        grad = inp.grad if grad is None else grad
        if grad is None:
            raise RuntimeError(
                f"stage {self.stage.pp_rank} got no gradient for its input of micro-batch "
                f"{key[0]}: its output does not depend on its input differentiably (detach()?)")
        return grad

    def _send_grad(self, a: SendGrad) -> None:
        st = self.stage
        grad = self._input_grad((a.mb, a.chunk))
        self.sends.append(p2p.send_grad(grad, st.peer(a.chunk, -1), st.grad_group))
