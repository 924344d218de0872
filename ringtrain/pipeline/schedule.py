"""Pipeline schedules as plain data: one list of actions per rank (`actions.py`).

    gpipe        every forward, then every backward (Huang et al., 2019)
    1f1b         warm up, then one forward one backward (PipeDream-Flush, Narayanan et al., 2021)
    interleaved  1F1B over v chunks per rank (Narayanan et al., 2021): bubble (p-1)/(v*m)
    zb-h1        1F1B with the backward split in two, weight gradients filling the bubble
                 (zero-bubble pipeline parallelism, ZB-H1, Qi et al., 2023)
    zb-v         two chunks per rank in a V, split backward (ZB-V, same paper): the bubble
                 shrinks to one chunk's forward per rank at 1F1B's activation memory

Builders are pure: `(pp_rank, pp, microbatches, virtual_stages)` in, actions out; `placement`
says where each schedule puts its chunks (`placement.py`). Every schedule is checked by
`validate` (`validate.py`) before anything is sent.

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
from ringtrain.pipeline.placement import Placement
from ringtrain.pipeline.validate import UNIT_COST, Timing, peak_in_flight, simulate, validate

__all__ = [
    "BUBBLE_FORMULA_TEXT", "COMPUTE", "SCHEDULES", "Action", "Backward", "BackwardInput",
    "BackwardWeight", "Forward", "RecvActivation", "RecvGrad", "Schedule", "ScheduleError",
    "SendActivation", "SendGrad", "Timing", "V_SHAPED", "bubble_formula", "build_schedule",
    "chunks_per_rank", "gpipe", "interleaved", "one_f_one_b", "peak_in_flight", "placement",
    "simulate", "validate", "zb_h1", "zb_v",
]


def _check_args(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 1,
                name: str = "") -> None:
    if pp < 1:
        raise ValueError(f"pp={pp}: the number of pipeline stages must be at least 1")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"Invalid pp_rank {pp_rank}, it should be in the interval [0, {pp - 1}]")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be at least 1")
    if virtual_stages != 1 and name not in ("interleaved", "zb-v"):
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


def zb_v(pp_rank: int, pp: int, microbatches: int, virtual_stages: int = 2) -> list[Action]:
    """ZB-V (Qi et al., 2023, section 6): two chunks per rank placed in a V (`placement.py`:
    rank r holds stages r and 2pp-1-r), the backward split as in ZB-H1. Weight passes fill
    the warm-up and cool-down; with F = B = W the bubble is (pp-1)/(6m + pp-1) (one chunk's
    F + B - W = F of idle per rank at each end, against 6 chunk-passes per micro-batch), a
    sixth of 1F1B's idle time, at 1F1B's peak activation memory (2pp chunk-activations, each
    half a stage: pp stages' worth).

    The order of compute is torch's `ScheduleZBVZeroBubble`: rank r warms up with 2(pp-r)-1
    forwards of chunk 0, then r pairs (chunk 1, chunk 0), then pp-r rounds of chunk 1's F, B,
    W; the steady state runs F B W on chunk 0 then on chunk 1; the cool-down defers weight
    passes into the drain. Micro-batches are counted as if there were at least 2pp-1 of them
    (the warm-up's length) and the missing ones left out, so m < 2pp-1 keeps the same order.
    Receives go right before the pass that needs them, sends right after.
    """
    _check_args(pp_rank, pp, microbatches, 1, "zb-v")
    if virtual_stages != 2:
        chunks_per_rank("zb-v", virtual_stages)  # names the fix for anything but 1
        raise ValueError("zb_v builds 2 chunks per rank: pass virtual_stages=2 "
                         "(build_schedule does)")
    r, n = pp_rank, max(2 * pp - 1, microbatches)
    order: list[tuple[type, int, int]] = []  # (kind, mb, chunk)
    f, b, w = [0, 0], [0, 0], [0, 0]

    def run(kind: type, c: int) -> None:
        count = {Forward: f, BackwardInput: b, BackwardWeight: w}[kind]
        order.append((kind, count[c], c))
        count[c] += 1

    for _ in range(2 * (pp - r) - 1):
        run(Forward, 0)
    for _ in range(r):
        run(Forward, 1)
        run(Forward, 0)
    for _ in range(pp - r):
        run(Forward, 1)
        run(BackwardInput, 1)
        run(BackwardWeight, 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run(Forward, 0)
        for c in (0, 1):
            if c:
                run(Forward, 1)
            run(BackwardInput, c)
            run(BackwardWeight, c)
    for _ in range(r):
        run(BackwardInput, 0)
        run(BackwardInput, 1)
    for _ in range(pp - r):
        run(BackwardInput, 0)
        run(BackwardWeight, 0)
    while w[1] < b[1]:
        run(BackwardWeight, 1)
    while w[0] < b[0]:
        run(BackwardWeight, 0)

    place = Placement(pp, 2, v_shape=True)
    # Per chunk: is the previous / next stage on another rank (a message), or none / local?
    remote = [tuple(place.neighbour(r, c, step) not in (None, (r, 1 - c)) for step in (-1, 1))
              for c in (0, 1)]
    actions: list[Action] = []
    for kind, mb, c in order:
        if mb >= microbatches:
            continue
        recv_prev, send_next = remote[c]
        if kind is Forward:
            actions += [RecvActivation(mb, c)] * recv_prev + [Forward(mb, c)]
            actions += [SendActivation(mb, c)] * send_next
        elif kind is BackwardInput:
            actions += [RecvGrad(mb, c)] * send_next + [BackwardInput(mb, c)]
            actions += [SendGrad(mb, c)] * recv_prev
        else:
            actions.append(BackwardWeight(mb, c))
    return actions


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
    "zb-v": zb_v}
# Schedules whose chunks sit in a V (`placement.py`); the others loop.
V_SHAPED = frozenset({"zb-v"})


def chunks_per_rank(name: str, virtual_stages: int) -> int:
    """Model chunks each rank holds under schedule `name`: zb-v always 2, else as asked."""
    if name in V_SHAPED and virtual_stages not in (1, 2):
        raise ValueError(f"virtual_stages={virtual_stages}: {name} holds 2 chunks per rank in a "
                         "V (use --virtual-stages 1, its default, or 2)")
    return 2 if name in V_SHAPED else virtual_stages


def placement(name: str, pp: int, virtual_stages: int = 1) -> Placement:
    """Where schedule `name` puts each virtual stage."""
    return Placement(pp, chunks_per_rank(name, virtual_stages), v_shape=name in V_SHAPED)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Every rank's actions for the schedule called `name` (one of `SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not known; choose one of {sorted(SCHEDULES)}")
    v = chunks_per_rank(name, virtual_stages)
    return [SCHEDULES[name](s, pp, microbatches, v) for s in range(pp)]


def bubble_formula(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The fraction of a step each rank idles, by the schedule's analysis, when a stage's
    forward, input-gradient and weight-gradient passes take equal time (F = B = W):

        gpipe, 1f1b   (p-1) / (m + p-1)          (p-1)(F+B+W) idle against m(F+B+W) busy
        interleaved   (p-1) / (v*m + p-1)        idle/busy = (p-1)/(v*m), the issue's figure
        zb-h1         (p-1) / (3m + p-1)         idle (p-1)(F+B-W) = (p-1)F: a third of 1F1B's
        zb-v          (p-1) / (6m + p-1)         idle (p-1)F/2, one chunk's forward per rank:
                                                 the least any 2-chunk schedule can idle (the
                                                 last rank waits for p-1 of them to start)

    With fewer micro-batches (zb-h1: m < p, zb-v: m < 2p-1) the weight passes cannot fill the
    warm-up: no closed form, the simulated schedule's bubble (`simulate`, exact under F = B =
    W) instead.
    """
    p, m, v = pp, microbatches, virtual_stages
    if (name == "zb-h1" and m < p) or (name == "zb-v" and m < 2 * p - 1):
        v = chunks_per_rank(name, v)
        cost = {kind: t / v for kind, t in UNIT_COST.items()}  # a chunk is 1/v of a stage
        return simulate(build_schedule(name, p, m, v), m, v, cost, name in V_SHAPED).bubble
    scale = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m, "zb-v": 6 * m}[name]
    return (p - 1) / (scale + p - 1)


# `bubble_formula` in words, for explanations ("... = 5.9% of the step").
BUBBLE_FORMULA_TEXT = {"gpipe": "(pp-1)/(M+pp-1)", "1f1b": "(pp-1)/(M+pp-1)",
                       "interleaved": "(pp-1)/(v*M+pp-1)", "zb-h1": "(pp-1)/(3M+pp-1)",
                       "zb-v": "(pp-1)/(6M+pp-1)"}
