"""Pipeline schedules as plain data, and a validator that runs them on paper first.

A schedule is one list of actions per stage. Actions are small frozen dataclasses naming a
micro-batch: `Forward(mb)`, `Backward(mb)`, `SendActivation(mb)`, `RecvActivation(mb)`,
`SendGrad(mb)`, `RecvGrad(mb)`. Activations flow from stage s to s+1, gradients back.

Communication model (what `engine.py` does): a send is posted without waiting (`isend`) and
completes once its receive is posted; a receive blocks until the matching send has been
posted. Messages between two stages match in posting order, so the k-th `RecvActivation` on
stage s+1 must be for the same micro-batch as stage s's k-th `SendActivation`, or the data
would silently land in the wrong micro-batch. `validate` simulates all stages together under
this model and raises, naming the stuck stages and their actions, instead of letting the
real run hang.

    .venv/bin/pytest -q tests/test_schedule.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    mb: int


@dataclass(frozen=True)
class Backward:
    mb: int


@dataclass(frozen=True)
class SendActivation:
    mb: int


@dataclass(frozen=True)
class RecvActivation:
    mb: int


@dataclass(frozen=True)
class SendGrad:
    mb: int


@dataclass(frozen=True)
class RecvGrad:
    mb: int


Action = Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad
Schedule = list[list[Action]]  # schedule[pp_rank] = that stage's actions, in order


class ScheduleError(ValueError):
    """A schedule that would deadlock, mismatch messages or skip a micro-batch."""


def _check_args(pp_rank: int, pp: int, microbatches: int) -> None:
    if pp < 1:
        raise ValueError(f"pp={pp}: the number of pipeline stages must be at least 1")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"Invalid pp_rank {pp_rank}, it should be in the interval [0, {pp - 1}]")
    if microbatches < pp:
        raise ValueError(
            f"microbatches={microbatches} is fewer than pp={pp} stages: some stages would "
            f"never overlap. Use --microbatches {pp} or more (4 x pp keeps the bubble under "
            f"{(pp - 1) / (5 * pp - 1):.0%})"
        )


def _forward(mb: int, pp_rank: int, pp: int) -> list[Action]:
    recv = [RecvActivation(mb)] if pp_rank > 0 else []
    send = [SendActivation(mb)] if pp_rank < pp - 1 else []
    return [*recv, Forward(mb), *send]


def _backward(mb: int, pp_rank: int, pp: int) -> list[Action]:
    recv = [RecvGrad(mb)] if pp_rank < pp - 1 else []
    send = [SendGrad(mb)] if pp_rank > 0 else []
    return [*recv, Backward(mb), *send]


def gpipe(pp_rank: int, pp: int, microbatches: int) -> list[Action]:
    """GPipe (Huang et al., 2019): every forward, then every backward.

    Holds all `microbatches` activations until the backward phase.
    """
    _check_args(pp_rank, pp, microbatches)
    actions: list[Action] = []
    for mb in range(microbatches):
        actions += _forward(mb, pp_rank, pp)
    for mb in range(microbatches):
        actions += _backward(mb, pp_rank, pp)
    return actions


def one_f_one_b(pp_rank: int, pp: int, microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): warm up, then one forward, one backward.

    Stage s runs `pp - s - 1` warm-up forwards, alternates forward/backward in the steady
    state and drains the remaining backwards, so it holds at most `pp - s` micro-batches'
    activations at once; the bubble is the same as GPipe's, (pp-1)/(M+pp-1).
    """
    _check_args(pp_rank, pp, microbatches)
    warmup = min(pp - pp_rank - 1, microbatches)
    actions: list[Action] = []
    for mb in range(warmup):
        actions += _forward(mb, pp_rank, pp)
    for i in range(microbatches - warmup):
        actions += _forward(warmup + i, pp_rank, pp)
        actions += _backward(i, pp_rank, pp)
    for mb in range(microbatches - warmup, microbatches):
        actions += _backward(mb, pp_rank, pp)
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe,
                                                                  "1f1b": one_f_one_b}


def build_schedule(name: str, pp: int, microbatches: int) -> Schedule:
    """Every stage's actions for the schedule called `name` ('gpipe' or '1f1b')."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not known; choose one of {sorted(SCHEDULES)}")
    return [SCHEDULES[name](s, pp, microbatches) for s in range(pp)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at once (activations held)."""
    live = peak = 0
    for a in actions:
        if isinstance(a, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(a, Backward):
            live -= 1
    return peak


def _local_error(stage: int, step: int, a: Action, done: set[Action], pp: int) -> str | None:
    """Why stage `stage` may not run action `a` given what it already did, if it may not."""
    if a in done:
        return f"stage {stage} runs {a} twice (step {step})"
    need: list[Action] = []
    if isinstance(a, (RecvActivation, SendGrad)) and stage == 0:
        return f"stage 0 has no previous stage for {a} (step {step})"
    if isinstance(a, (SendActivation, RecvGrad)) and stage == pp - 1:
        return f"stage {stage} is the last stage and has no next stage for {a} (step {step})"
    if isinstance(a, Forward) and stage > 0:
        need = [RecvActivation(a.mb)]
    elif isinstance(a, SendActivation):
        need = [Forward(a.mb)]
    elif isinstance(a, RecvGrad):
        need = [SendActivation(a.mb)]
    elif isinstance(a, Backward):
        need = [Forward(a.mb)] + ([RecvGrad(a.mb)] if stage < pp - 1 else [])
    elif isinstance(a, SendGrad):
        need = [Backward(a.mb)]
    missing = [n for n in need if n not in done]
    if missing:
        return f"stage {stage} runs {a} (step {step}) before {', '.join(map(str, missing))}"
    return None


def validate(schedule: Sequence[Sequence[Action]], microbatches: int) -> None:
    """Run all stages' actions together on paper; raise `ScheduleError` if it cannot finish.

    Checks, for every stage: each micro-batch is forwarded and backwarded exactly once, each
    action comes after what it depends on, every send has a receive for the same micro-batch
    in the same order on the neighbouring stage, and no set of stages waits on each other.
    """
    pp = len(schedule)
    if pp < 1:
        raise ScheduleError("the schedule has no stages")
    for s, actions in enumerate(schedule):
        for kind in (Forward, Backward):
            mbs = sorted(a.mb for a in actions if isinstance(a, kind))
            if mbs != list(range(microbatches)):
                raise ScheduleError(
                    f"stage {s} runs {kind.__name__} for micro-batches {mbs}, expected each of "
                    f"0..{microbatches - 1} exactly once"
                )
    # channel -> micro-batches posted and not yet received, in order.
    # ("act", s): activations from s to s+1; ("grad", s): gradients from s to s-1.
    posted: dict[tuple[str, int], list[int]] = {}
    pc = [0] * pp
    done: list[set[Action]] = [set() for _ in range(pp)]
    while any(pc[s] < len(schedule[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pc[s] < len(schedule[s]):
                a = schedule[s][pc[s]]
                error = _local_error(s, pc[s], a, done[s], pp)
                if error:
                    raise ScheduleError(error)
                if isinstance(a, (RecvActivation, RecvGrad)):
                    channel = ("act", s - 1) if isinstance(a, RecvActivation) else ("grad", s + 1)
                    queue = posted.get(channel, [])
                    if not queue:
                        break  # blocked: the sender has not posted it yet
                    if queue[0] != a.mb:
                        peer = channel[1]
                        kind = "SendActivation" if channel[0] == "act" else "SendGrad"
                        raise ScheduleError(
                            f"message order mismatch: stage {s} expects {a} (step {pc[s]}) but "
                            f"the next message from stage {peer} is {kind}(mb={queue[0]}); "
                            "sends and receives between two stages must list micro-batches in "
                            "the same order"
                        )
                    queue.pop(0)
                elif isinstance(a, SendActivation):
                    posted.setdefault(("act", s), []).append(a.mb)
                elif isinstance(a, SendGrad):
                    posted.setdefault(("grad", s), []).append(a.mb)
                done[s].add(a)
                pc[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} waits at step {pc[s]} on {schedule[s][pc[s]]}"
                     for s in range(pp) if pc[s] < len(schedule[s])]
            raise ScheduleError("the schedule deadlocks: " + "; ".join(stuck))
    unreceived = {ch: q for ch, q in posted.items() if q}
    if unreceived:
        (kind, s), q = next(iter(unreceived.items()))
        name, peer = ("SendActivation", s + 1) if kind == "act" else ("SendGrad", s - 1)
        raise ScheduleError(f"stage {s} sends {name}(mb={q[0]}) that stage {peer} never receives")
