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
from ringtrain.pipeline.placement import Placement


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


def _missing(done: set[tuple[type, int, int]], kinds: tuple[type, ...], mb: int,
             chunk: int) -> list[Action]:
    """[the first of `kinds`] unless one of them was done for (mb, chunk)."""
    for k in kinds:
        if (k, mb, chunk) in done:
            return []
    return [kinds[0](mb, chunk)]


_BACKWARD = (Backward, BackwardInput)
_BACKWARDS = (BackwardInput, Backward)  # as named in an error: a split backward's first half


def _local_error(rank: int, step: int, a: Action, done: set[tuple[type, int, int]], first: bool,
                 last: bool, prev: int | None, nxt: int | None) -> str | None:
    """Why rank `rank` may not run `a` given what it already did, if it may not. `first`/`last`:
    `a`'s chunk is the first/last virtual stage of the pipeline; `prev`/`nxt`: the chunk of
    this rank that holds the previous/next stage (the bottom of a V), else None. `done` holds
    (type, mb, chunk) (tuples hash in C; this runs for every action of every schedule the
    sweep test checks)."""
    kind, mb, c = type(a), a.mb, a.chunk
    if (kind, mb, c) in done:
        return f"stage {rank} runs {a} twice (step {step})"
    if kind is RecvActivation or kind is SendGrad:
        if first:
            return f"stage {rank} has no previous stage for {a} (step {step})"
        if prev is not None:
            return (f"stage {rank} runs {a} (step {step}) but its previous stage is its own "
                    f"chunk {prev}: they hand over without a message")
    if kind is SendActivation or kind is RecvGrad:
        if last:
            return f"stage {rank} is the last stage and has no next stage for {a} (step {step})"
        if nxt is not None:
            return (f"stage {rank} runs {a} (step {step}) but its next stage is its own "
                    f"chunk {nxt}: they hand over without a message")
    if kind is Forward:
        missing = (_missing(done, (Forward,), mb, prev) if prev is not None
                   else [] if first else _missing(done, (RecvActivation,), mb, c))
    elif kind is Backward or kind is BackwardInput:
        missing = _missing(done, (Forward,), mb, c) + (
            _missing(done, _BACKWARDS, mb, nxt) if nxt is not None
            else [] if last else _missing(done, (RecvGrad,), mb, c))
    elif kind is BackwardWeight:
        missing = _missing(done, (BackwardInput,), mb, c)
    elif kind is SendActivation:
        missing = _missing(done, (Forward,), mb, c)
    elif kind is RecvGrad:
        missing = _missing(done, (SendActivation,), mb, c)
    elif kind is SendGrad:  # a split backward's first half sends the input gradient
        missing = _missing(done, _BACKWARDS, mb, c)
    else:
        missing = []
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


def _compile(rank: int, actions: Sequence[Action], place: Placement,
             cost: Mapping[type, float]) -> list[tuple]:
    """Check one rank's own order (what depends only on its list), then reduce each action to
    what the cross-rank walk needs: ("c", seconds) | ("s", channel, message) | ("r", channel,
    message). A channel is (kind, src rank, dst rank); a message (mb, chunk at the receiver)."""
    last_virtual = place.stages - 1
    # Per chunk, the same for every action of it: (first, last, prev, next) for _local_error,
    # and the (rank, chunk) of the previous and next stage (None past the ends).
    ends, peers = {}, {}
    for c in range(place.v):
        k = place.stage(rank, c)
        ends[c] = (k == 0, k == last_virtual, place.local(rank, c, -1), place.local(rank, c, 1))
        peers[c] = (place.neighbour(rank, c, -1), place.neighbour(rank, c, 1))
    done: set[tuple[type, int, int]] = set()
    ops: list[tuple] = []
    for step, a in enumerate(actions):
        error = _local_error(rank, step, a, done, *ends[a.chunk])
        if error:
            raise ScheduleError(error)
        kind = type(a)
        done.add((kind, a.mb, a.chunk))
        if kind in COMPUTE:
            ops.append(("c", cost[kind]))
        elif kind is SendActivation or kind is SendGrad:
            act = kind is SendActivation
            dst = peers[a.chunk][act]  # _local_error: not past either end
            ops.append(("s", ("act" if act else "grad", rank, dst[0]), (a.mb, dst[1])))
        else:
            act = kind is RecvActivation
            src = peers[a.chunk][not act]
            ops.append(("r", ("act" if act else "grad", src[0], rank), (a.mb, a.chunk)))
    return ops


def _run(schedule: Sequence[Sequence[Action]], microbatches: int, v: int, v_shape: bool,
         cost: Mapping[type, float]) -> Timing:
    pp = len(schedule)
    if pp < 1:
        raise ScheduleError("the schedule has no stages")
    _check_counts(schedule, microbatches, v)
    place = Placement(pp, v, v_shape)
    ops = [_compile(s, actions, place, cost) for s, actions in enumerate(schedule)]
    # channel -> (message, time posted) not yet received, in posting order
    posted: dict[tuple[str, int, int], deque[tuple[tuple[int, int], float]]] = {}
    pc, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    while any(pc[s] < len(ops[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            mine, i, t = ops[s], pc[s], clock[s]
            while i < len(mine):
                op = mine[i]
                if op[0] == "c":
                    t += op[1]
                    busy[s] += op[1]
                elif op[0] == "s":
                    posted.setdefault(op[1], deque()).append((op[2], t))
                else:
                    queue = posted.get(op[1])
                    if not queue:
                        break  # blocked: the sender has not posted it yet
                    message, sent = queue[0]
                    if message != op[2]:
                        kind = "SendActivation" if op[1][0] == "act" else "SendGrad"
                        raise ScheduleError(
                            f"message order mismatch: stage {s} expects {schedule[s][i]} (step "
                            f"{i}) but the next message from stage {op[1][1]} is {kind} for "
                            f"mb={message[0]}, chunk {message[1]}; sends and receives between "
                            "two stages must list micro-batches in the same order")
                    queue.popleft()
                    t = max(t, sent)
                i += 1
            if i != pc[s]:
                progressed = True
            pc[s], clock[s] = i, t
        if not progressed:
            stuck = [f"stage {s} waits at step {pc[s]} on {schedule[s][pc[s]]}"
                     for s in range(pp) if pc[s] < len(ops[s])]
            raise ScheduleError("the schedule deadlocks: " + "; ".join(stuck))
    unreceived = {ch: q for ch, q in posted.items() if q}
    if unreceived:
        (kind, s, peer), q = next(iter(unreceived.items()))
        name = "SendActivation" if kind == "act" else "SendGrad"
        raise ScheduleError(f"stage {s} sends {name}(mb={q[0][0][0]}) that stage {peer} never "
                            "receives")
    return Timing(busy, clock)


UNIT_COST: dict[type, float] = {Forward: 1.0, Backward: 2.0, BackwardInput: 1.0,
                                BackwardWeight: 1.0}


def validate(schedule: Sequence[Sequence[Action]], microbatches: int,
             virtual_stages: int = 1, v_shape: bool = False) -> None:
    """Run all ranks' actions together on paper; raise `ScheduleError` if they cannot finish.

    Checks, for every rank and chunk: each micro-batch is forwarded and backwarded exactly once
    (a split backward: both halves), each action comes after what it depends on, every send has
    a receive for the same micro-batch and chunk in the same order on the neighbouring rank, and
    no set of ranks waits on each other. `v_shape`: chunks are placed in a V (`placement.py`),
    not in a loop.
    """
    _run(schedule, microbatches, virtual_stages, v_shape, UNIT_COST)


def simulate(schedule: Sequence[Sequence[Action]], microbatches: int, virtual_stages: int = 1,
             cost: Mapping[type, float] | None = None, v_shape: bool = False) -> Timing:
    """`validate`, timed: each compute action takes `cost[type]` (default F=1, B=2, split
    B=W=1), messages take no time. Raises `ScheduleError` as `validate` does."""
    return _run(schedule, microbatches, virtual_stages, v_shape, cost or UNIT_COST)
