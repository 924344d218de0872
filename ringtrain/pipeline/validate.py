"""Run a pipeline schedule on paper: prove it finishes, and time it under a cost model.

Communication model (what `engine.py` does): a send is posted without waiting (`isend`) and
completes once its receive is posted; a receive blocks until the matching send has been
posted. Activations and gradients travel on two tags, so between two ranks there are two
ordered channels; on each, messages match in posting order: the k-th `RecvActivation` on a rank
must be for the same micro-batch and chunk as its neighbour's k-th `SendActivation`, or the
data would silently land in the wrong place. `validate` simulates all ranks together under this
model and raises, naming the stuck ranks and their actions, instead of letting the real run hang.
`simulate` is the same walk with a time per compute action: the bubble a schedule has on
stages whose compute takes exactly that long (the benchmark's sleep model checks it).

    .venv/bin/pytest -q tests/test_schedule.py
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringtrain.pipeline.actions import (
    COMPUTE,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
)


@dataclass(frozen=True)
class Timing:
    """A schedule's run under a cost model: per rank, compute time and when it finished."""

    busy: list[float]
    end: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end)

    @property
    def bubble(self) -> float:
        """The fraction of rank-time idle: 1 - compute / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (micro-batch, chunk) pairs forwarded and not yet done with backward at once: the
    activations held. A split backward frees them only at `BackwardWeight` (it needs them)."""
    live = peak = 0
    for a in actions:
        if isinstance(a, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(a, (Backward, BackwardWeight)):
            live -= 1
    return peak


def _local_error(rank: int, step: int, a: Action, done: set[Action], first: bool,
                 last: bool) -> str | None:
    """Why rank `rank` may not run `a` given what it already did, if it may not. `first`/`last`:
    `a`'s chunk is the first/last virtual stage of the pipeline."""
    if a in done:
        return f"stage {rank} runs {a} twice (step {step})"
    if isinstance(a, (RecvActivation, SendGrad)) and first:
        return f"stage {rank} has no previous stage for {a} (step {step})"
    if isinstance(a, (SendActivation, RecvGrad)) and last:
        return f"stage {rank} is the last stage and has no next stage for {a} (step {step})"
    mb, c = a.mb, a.chunk
    need: list[Action] = []
    if isinstance(a, Forward) and not first:
        need = [RecvActivation(mb, c)]
    elif isinstance(a, SendActivation):
        need = [Forward(mb, c)]
    elif isinstance(a, RecvGrad):
        need = [SendActivation(mb, c)]
    elif isinstance(a, (Backward, BackwardInput)):
        need = [Forward(mb, c)] + ([] if last else [RecvGrad(mb, c)])
    elif isinstance(a, BackwardWeight):
        need = [BackwardInput(mb, c)]
    elif isinstance(a, SendGrad) and Backward(mb, c) not in done:
        need = [BackwardInput(mb, c)]
    missing = [n for n in need if n not in done]
    if missing:
        return f"stage {rank} runs {a} (step {step}) before {', '.join(map(str, missing))}"
    return None


def _check_counts(schedule: Sequence[Sequence[Action]], microbatches: int, v: int) -> None:
    every = list(range(microbatches))
    for s, actions in enumerate(schedule):
        bad = [a for a in actions if not 0 <= a.chunk < v]
        if bad:
            raise ScheduleError(f"stage {s} runs {bad[0]} but has chunks 0..{v - 1} "
                                f"(virtual_stages={v})")
        for c in range(v):
            mine = [a for a in actions if a.chunk == c]
            fwd = sorted(a.mb for a in mine if isinstance(a, Forward))
            whole = sorted(a.mb for a in mine if isinstance(a, (Backward, BackwardInput)))
            split = sorted(a.mb for a in mine if isinstance(a, BackwardInput))
            weight = sorted(a.mb for a in mine if isinstance(a, BackwardWeight))
            for kind, mbs in (("Forward", fwd), ("Backward", whole)):
                if mbs != every:
                    where = f" of chunk {c}" if v > 1 else ""
                    raise ScheduleError(
                        f"stage {s} runs {kind} for micro-batches {mbs}{where}, expected each of "
                        f"0..{microbatches - 1} exactly once (a BackwardInput counts as Backward)")
            if split != weight:
                raise ScheduleError(f"stage {s} chunk {c}: BackwardInput for micro-batches "
                                    f"{split} but BackwardWeight for {weight}; each needs the "
                                    "other")


def _run(schedule: Sequence[Sequence[Action]], microbatches: int, v: int,
         cost: Mapping[type, float]) -> Timing:
    pp = len(schedule)
    if pp < 1:
        raise ScheduleError("the schedule has no stages")
    _check_counts(schedule, microbatches, v)
    last_virtual = pp * v - 1
    # (kind, src rank, dst rank) -> (mb, dst chunk, time posted) not yet received, in order
    posted: dict[tuple[str, int, int], deque[tuple[int, int, float]]] = {}
    pc, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    done: list[set[Action]] = [set() for _ in range(pp)]
    while any(pc[s] < len(schedule[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            actions = schedule[s]
            while pc[s] < len(actions):
                a = actions[pc[s]]
                k = a.chunk * pp + s  # virtual stage
                error = _local_error(s, pc[s], a, done[s], k == 0, k == last_virtual)
                if error:
                    raise ScheduleError(error)
                if isinstance(a, (RecvActivation, RecvGrad)):
                    act = isinstance(a, RecvActivation)
                    peer = (k - 1) % pp if act else (k + 1) % pp
                    queue = posted.get(("act" if act else "grad", peer, s))
                    if not queue:
                        break  # blocked: the sender has not posted it yet
                    mb, chunk, t = queue[0]
                    if (mb, chunk) != (a.mb, a.chunk):
                        kind = "SendActivation" if act else "SendGrad"
                        raise ScheduleError(
                            f"message order mismatch: stage {s} expects {a} (step {pc[s]}) but "
                            f"the next message from stage {peer} is {kind} for mb={mb}, chunk "
                            f"{chunk}; sends and receives between two stages must list "
                            "micro-batches in the same order")
                    queue.popleft()
                    clock[s] = max(clock[s], t)
                elif isinstance(a, (SendActivation, SendGrad)):
                    dst = k + 1 if isinstance(a, SendActivation) else k - 1
                    kind = "act" if isinstance(a, SendActivation) else "grad"
                    posted.setdefault((kind, s, dst % pp), deque()).append(
                        (a.mb, dst // pp, clock[s]))
                elif isinstance(a, COMPUTE):
                    t = cost[type(a)]
                    clock[s] += t
                    busy[s] += t
                done[s].add(a)
                pc[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} waits at step {pc[s]} on {schedule[s][pc[s]]}"
                     for s in range(pp) if pc[s] < len(schedule[s])]
            raise ScheduleError("the schedule deadlocks: " + "; ".join(stuck))
    unreceived = {ch: q for ch, q in posted.items() if q}
    if unreceived:
        (kind, s, peer), q = next(iter(unreceived.items()))
        name = "SendActivation" if kind == "act" else "SendGrad"
        raise ScheduleError(f"stage {s} sends {name}(mb={q[0][0]}) that stage {peer} never "
                            "receives")
    return Timing(busy, clock)


UNIT_COST: dict[type, float] = {Forward: 1.0, Backward: 2.0, BackwardInput: 1.0,
                                BackwardWeight: 1.0}


def validate(schedule: Sequence[Sequence[Action]], microbatches: int,
             virtual_stages: int = 1) -> None:
    """Run all ranks' actions together on paper; raise `ScheduleError` if they cannot finish.

    Checks, for every rank and chunk: each micro-batch is forwarded and backwarded exactly once
    (a split backward: both halves), each action comes after what it depends on, every send has
    a receive for the same micro-batch and chunk in the same order on the neighbouring rank, and
    no set of ranks waits on each other.
    """
    _run(schedule, microbatches, virtual_stages, UNIT_COST)


def simulate(schedule: Sequence[Sequence[Action]], microbatches: int, virtual_stages: int = 1,
             cost: Mapping[type, float] | None = None) -> Timing:
    """`validate`, timed: each compute action takes `cost[type]` (default F=1, B=2, split
    B=W=1), messages take no time. Raises `ScheduleError` as `validate` does."""
    return _run(schedule, microbatches, virtual_stages, cost or UNIT_COST)
