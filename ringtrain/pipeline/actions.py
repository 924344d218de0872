"""The actions a pipeline schedule is made of: small frozen dataclasses, no behaviour.

Each names a micro-batch `mb` and a `chunk`: the index of the model chunk on this rank. With
one chunk per rank (GPipe, 1F1B, ZB-H1) the chunk is always 0 and virtual stage = pp_rank;
interleaved schedules give each rank `v` chunks, chunk c of rank r being virtual stage
`c * pp + r` (Narayanan et al., 2021), so activations flow r -> r+1 and, at the last rank,
wrap around to rank 0's next chunk; gradients flow back the same way. ZB-V places its two
chunks in a V instead (stages r and 2pp-1-r; `placement.py` says where each stage lives).

`Backward` computes both gradients at once; zero-bubble schedules (Qi et al., 2023) split it
into `BackwardInput` (d loss / d input: the next stage back waits on it) and `BackwardWeight`
(d loss / d parameters: nobody waits on it, so it fills idle time).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, repr=False)
class _Action:
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:  # chunk 0 stays quiet: most schedules have one chunk
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"{type(self).__name__}(mb={self.mb}{chunk})"


@dataclass(frozen=True, repr=False)
class Forward(_Action):
    pass


@dataclass(frozen=True, repr=False)
class Backward(_Action):
    """Input and weight gradients together (GPipe, 1F1B, interleaved)."""


@dataclass(frozen=True, repr=False)
class BackwardInput(_Action):
    """d loss / d input only; the graph is kept for `BackwardWeight`."""


@dataclass(frozen=True, repr=False)
class BackwardWeight(_Action):
    """d loss / d parameters, after `BackwardInput` of the same micro-batch and chunk."""


@dataclass(frozen=True, repr=False)
class SendActivation(_Action):
    pass


@dataclass(frozen=True, repr=False)
class RecvActivation(_Action):
    pass


@dataclass(frozen=True, repr=False)
class SendGrad(_Action):
    pass


@dataclass(frozen=True, repr=False)
class RecvGrad(_Action):
    pass


Action = (Forward | Backward | BackwardInput | BackwardWeight | SendActivation | RecvActivation
          | SendGrad | RecvGrad)
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
Schedule = list[list[Action]]  # schedule[pp_rank] = that rank's actions, in order


class ScheduleError(ValueError):
    """A schedule that would deadlock, mismatch messages or skip a micro-batch."""
