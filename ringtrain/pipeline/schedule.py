"""Pipeline schedules as plain data: one list of actions per rank (`actions.py`).

    gpipe        every forward, then every backward (Huang et al., 2019)
    1f1b         warm up, then one forward one backward (PipeDream-Flush, Narayanan et al., 2021)
    interleaved  1F1B over v chunks per rank (Narayanan et al., 2021): bubble (p-1)/(v*m)
    zb-h1        1F1B with the backward split in two, weight gradients filling the bubble
                 (zero-bubble pipeline parallelism, ZB-H1, Qi et al., 2023)

Builders are pure: `(pp_rank, pp, microbatches, virtual_stages)` in, actions out. Every schedule
is checked by `validate` (`validate.py`) before anything is sent.

    .venv/bin/pytest -q tests/test_schedule.py
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ringtrain.pipeline.actions import (
    COMPUTE,
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
)
from ringtrain.pipeline.validate import Timing, peak_in_flight, simulate, validate

__all__ = [
    "BUBBLE_FORMULA_TEXT", "COMPUTE", "SCHEDULES", "Action", "Backward", "BackwardInput",
    "BackwardWeight", "Forward", "RecvActivation", "RecvGrad", "Schedule", "ScheduleError",
    "SendActivation", "SendGrad", "Timing", "bubble_formula", "build_schedule", "gpipe",
    "interleaved", "one_f_one_b", "peak_in_flight", "simulate", "validate", "zb_h1",
]


def _check_args(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 1,
                name: str = "") -> None:
    if pp < 1:
        raise ValueError(f"pp={pp}: the number of pipeline stages must be at least 1")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"Invalid pp_rank {pp_rank}, it should be in the interval [0, {pp - 1}]")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be at least 1")
    if virtual_stages != 1 and name != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} needs --schedule interleaved; "
                         f"{name!r} holds one stage per rank (use --virtual-stages 1)")


def _forward(mb: int, chunk: int, k: int, last: int) -> list[Action]:
    """Forward of virtual stage k (0..last) with its receive before and its send after."""
    recv = [RecvActivation(mb, chunk)] if k > 0 else []
    send = [SendActivation(mb, chunk)] if k < last else []
    return [*recv, Forward(mb, chunk), *send]


def _backward(mb: int, chunk: int, k: int, last: int, kind: type = Backward) -> list[Action]:
    recv = [RecvGrad(mb, chunk)] if k < last else []
    send = [SendGrad(mb, chunk)] if k > 0 else []
    return [*recv, kind(mb, chunk), *send]


def gpipe(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """GPipe (Huang et al., 2019): every forward, then every backward.

    Holds all `microbatches` activations until the backward phase.
    """
    _check_args(pp_rank, pp, microbatches, virtual_stages, "gpipe")
    actions: list[Action] = []
    for mb in range(microbatches):
        actions += _forward(mb, 0, pp_rank, pp - 1)
    for mb in range(microbatches):
        actions += _backward(mb, 0, pp_rank, pp - 1)
    return actions


def one_f_one_b(pp_rank: int, pp: int, microbatches: int,
                virtual_stages: int = 1) -> list[Action]:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): warm up, then one forward, one backward.

    Stage s runs `pp - s - 1` warm-up forwards, alternates forward/backward in the steady
    state and drains the remaining backwards, so it holds at most `pp - s` micro-batches'
    activations at once; the bubble is the same as GPipe's, (pp-1)/(M+pp-1).
    """
    _check_args(pp_rank, pp, microbatches, virtual_stages, "1f1b")
    warmup, last = min(pp - pp_rank - 1, microbatches), pp - 1
    actions: list[Action] = []
    for mb in range(warmup):
        actions += _forward(mb, 0, pp_rank, last)
    for i in range(microbatches - warmup):
        actions += _forward(warmup + i, 0, pp_rank, last)
        actions += _backward(i, 0, pp_rank, last)
    for mb in range(microbatches - warmup, microbatches):
        actions += _backward(mb, 0, pp_rank, last)
    return actions


def zb_h1(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B whose backward is split into input and weight gradients.

    The input gradient (`BackwardInput`) is all the previous stage waits for, so it runs at
    once; the weight gradient (`BackwardWeight`) waits, and fills time the stage would idle.
    Stage s defers up to `s` of them, so it holds at most `pp` micro-batches' activations
    (as 1F1B's stage 0 does: equal peak memory). With F = B = W the bubble is about a third
    of 1F1B's: (pp-1)/(3m + pp-1) against (pp-1)/(m + pp-1) x ... see docs/pipeline.md.
    """
    _check_args(pp_rank, pp, microbatches, virtual_stages, "zb-h1")
    warmup, last = min(pp - pp_rank - 1, microbatches), pp - 1
    deferred: deque[int] = deque()
    actions: list[Action] = []

    def backward(mb: int, keep: int) -> None:
        nonlocal actions
        actions += _backward(mb, 0, pp_rank, last, BackwardInput)
        deferred.append(mb)
        while len(deferred) > keep:
            actions.append(BackwardWeight(deferred.popleft(), 0))

    for mb in range(warmup):
        actions += _forward(mb, 0, pp_rank, last)
    for i in range(microbatches - warmup):
        actions += _forward(warmup + i, 0, pp_rank, last)
        backward(i, pp_rank)
    for mb in range(microbatches - warmup, microbatches):
        backward(mb, pp_rank)
    actions += [BackwardWeight(mb, 0) for mb in deferred]
    return actions


def interleaved(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., 2021, as in Megatron-LM): rank r holds chunks
    c = 0..v-1, chunk c being virtual stage c*pp + r, so each chunk is 1/v of a stage and the
    bubble shrinks to (pp-1)/(v*m).

    Micro-batches go in rounds of `pp`: forward step j runs chunk (j // pp) % v of micro-batch
    (j // (pp*v))*pp + j % pp, backward step j the chunks in reverse. Rank r warms up with
    (v-1)*pp + 2*(pp-r-1) forwards (Megatron's count), so it holds at most that many + 1
    chunk-activations. `microbatches` must be a multiple of `pp`.
    """
    v = virtual_stages
    _check_args(pp_rank, pp, microbatches, v, "interleaved")
    if v < 1:
        raise ValueError(f"virtual_stages={v} must be at least 1")
    if v > 1 and pp < 2:
        raise ValueError(f"virtual_stages={v} with pp={pp}: interleaving needs 2 or more ranks "
                         "to pass chunks between; use --virtual-stages 1 or --pp 2 or more")
    if microbatches < pp:  # the rounds of pp below would be empty
        raise ValueError(
            f"microbatches={microbatches} is fewer than pp={pp} stages: interleaved runs "
            f"micro-batches in rounds of pp. Use --microbatches {pp} or more (4 x pp keeps the "
            f"bubble under {(pp - 1) / (4 * v * pp + pp - 1):.0%}), or --schedule 1f1b, which "
            "runs fewer micro-batches than stages")
    if microbatches % pp:
        lo = microbatches - microbatches % pp
        fits = [n for n in (lo, lo + pp) if n >= pp]
        raise ValueError(f"microbatches={microbatches} is not a multiple of pp={pp}: interleaved "
                         f"runs micro-batches in rounds of pp. Use --microbatches in {fits}")
    total, last = microbatches * v, pp * v - 1

    def unit(j: int, backward: bool) -> tuple[int, int]:
        chunk = (j // pp) % v
        return (j // (pp * v)) * pp + j % pp, (v - 1 - chunk if backward else chunk)

    warmup = min((v - 1) * pp + 2 * (pp - pp_rank - 1), total)
    actions: list[Action] = []
    for j in range(warmup):
        mb, c = unit(j, False)
        actions += _forward(mb, c, c * pp + pp_rank, last)
    for j in range(total - warmup):
        mb, c = unit(warmup + j, False)
        actions += _forward(mb, c, c * pp + pp_rank, last)
        mb, c = unit(j, True)
        actions += _backward(mb, c, c * pp + pp_rank, last)
    for j in range(total - warmup, total):
        mb, c = unit(j, True)
        actions += _backward(mb, c, c * pp + pp_rank, last)
    return actions


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Every rank's actions for the schedule called `name` (one of `SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not known; choose one of {sorted(SCHEDULES)}")
    return [SCHEDULES[name](s, pp, microbatches, virtual_stages) for s in range(pp)]


def bubble_formula(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The fraction of a step each rank idles, by the schedule's analysis, when a stage's
    forward, input-gradient and weight-gradient passes take equal time (F = B = W):

        gpipe, 1f1b   (p-1) / (m + p-1)          (p-1)(F+B+W) idle against m(F+B+W) busy
        interleaved   (p-1) / (v*m + p-1)        idle/busy = (p-1)/(v*m), the issue's figure
        zb-h1         (p-1) / (3m + p-1)         idle (p-1)(F+B-W) = (p-1)F: a third of 1F1B's

    ZB-H1 with m < p has too few weight passes to fill the warm-up: no closed form, the
    simulated schedule's bubble (`simulate`, exact under F = B = W) instead.
    """
    p, m, v = pp, microbatches, virtual_stages
    if name == "zb-h1" and m < p:
        return simulate(build_schedule(name, p, m), m).bubble
    scale = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m}[name]
    return (p - 1) / (scale + p - 1)


# `bubble_formula` in words, for explanations ("... = 5.9% of the step").
BUBBLE_FORMULA_TEXT = {"gpipe": "(pp-1)/(M+pp-1)", "1f1b": "(pp-1)/(M+pp-1)",
                       "interleaved": "(pp-1)/(v*M+pp-1)", "zb-h1": "(pp-1)/(3M+pp-1)"}
