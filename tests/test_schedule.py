"""Pipeline schedules as data (`ringtrain.pipeline.schedule`): pure, no processes.

    .venv/bin/pytest -q tests/test_schedule.py
"""

import time

import pytest

from ringtrain.pipeline.schedule import (
    SCHEDULES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    bubble_formula,
    build_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    peak_in_flight,
    placement,
    simulate,
    validate,
    zb_h1,
    zb_v,
)
from ringtrain.pipeline.validate import UNIT_COST


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_valid_for_many_shapes(name):
    for pp in range(1, 7):
        for m in range(pp, 3 * pp + 3):
            validate(build_schedule(name, pp, m), m)


def test_gpipe_is_all_forwards_then_all_backwards():
    assert gpipe(0, 2, 3) == [
        Forward(0), SendActivation(0), Forward(1), SendActivation(1), Forward(2), SendActivation(2),
        RecvGrad(0), Backward(0), RecvGrad(1), Backward(1), RecvGrad(2), Backward(2),
    ]
    assert gpipe(1, 2, 2) == [
        RecvActivation(0), Forward(0), RecvActivation(1), Forward(1),
        Backward(0), SendGrad(0), Backward(1), SendGrad(1),
    ]


def test_1f1b_warmup_steady_cooldown():
    # Stage 0 of 3 warms up with 2 forwards, then alternates, then drains 2 backwards.
    kinds = [(type(a).__name__, a.mb) for a in one_f_one_b(0, 3, 4)
             if isinstance(a, (Forward, Backward))]
    assert kinds == [("Forward", 0), ("Forward", 1), ("Forward", 2), ("Backward", 0),
                     ("Forward", 3), ("Backward", 1), ("Backward", 2), ("Backward", 3)]
    # The last stage has no warm-up: F0 B0 F1 B1 ...
    last = [a for a in one_f_one_b(2, 3, 3) if isinstance(a, (Forward, Backward))]
    assert last == [Forward(0), Backward(0), Forward(1), Backward(1), Forward(2), Backward(2)]


@pytest.mark.parametrize("pp,m", [(2, 8), (3, 9), (4, 4), (4, 16)])
def test_1f1b_holds_at_most_pp_microbatches_gpipe_holds_all(pp, m):
    one = [peak_in_flight(a) for a in build_schedule("1f1b", pp, m)]
    assert one == [pp - s for s in range(pp)]
    assert [peak_in_flight(a) for a in build_schedule("gpipe", pp, m)] == [m] * pp


def test_deadlocking_schedule_is_rejected_naming_stages_and_actions():
    # Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation;
    # stage 1 wants activation 1 before it sends gradient 0: a cycle.
    schedule = [
        [Forward(0), SendActivation(0), Forward(1), RecvGrad(0), Backward(0), SendActivation(1),
         RecvGrad(1), Backward(1)],
        [RecvActivation(0), Forward(0), RecvActivation(1), Forward(1), Backward(0), SendGrad(0),
         Backward(1), SendGrad(1)],
    ]
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(schedule, 2)
    assert "stage 0 waits at step 3 on RecvGrad(mb=0)" in str(e.value)
    assert "stage 1 waits at step 2 on RecvActivation(mb=1)" in str(e.value)


def test_message_order_mismatch_is_rejected():
    # Stage 1 receives micro-batch 1 first, but stage 0 sends micro-batch 0 first.
    schedule = [gpipe(0, 2, 2), gpipe(1, 2, 2)]
    schedule[1] = [RecvActivation(1), Forward(1), RecvActivation(0), Forward(0),
                   Backward(0), SendGrad(0), Backward(1), SendGrad(1)]
    with pytest.raises(ScheduleError, match="order mismatch.*stage 1 expects RecvActivation"):
        validate(schedule, 2)


def test_local_order_errors():
    with pytest.raises(ScheduleError, match="before RecvActivation"):
        validate([gpipe(0, 2, 2), [Forward(0), RecvActivation(0), RecvActivation(1), Forward(1),
                                   Backward(0), SendGrad(0), Backward(1), SendGrad(1)]], 2)
    with pytest.raises(ScheduleError, match=r"Backward for micro-batches \[0\]"):
        validate([[Forward(0), Forward(1), Backward(0)]], 2)
    with pytest.raises(ScheduleError, match="stage 0 is the last stage and has no next stage"):
        validate([[Forward(0), SendActivation(0), Backward(0)]], 1)


def test_no_microbatches_or_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match=r"microbatches=0 must be at least 1"):
        one_f_one_b(0, 4, 0)
    with pytest.raises(ValueError, match="schedule='zigzag' is not known"):
        build_schedule("zigzag", 2, 4)


# -- every schedule, every shape ----------------------------------------------------------------
def _shapes():
    for name in SCHEDULES:
        for pp in range(1, 9):
            for m in range(1, 33):
                for v in (range(1, 5) if name == "interleaved" else [1]):
                    yield name, pp, m, v  # zb-v: 2 chunks whatever v says (build_schedule)


@pytest.mark.slow  # 2.4 s of CPU: over the fast tier's 2 s per test
def test_validator_proves_every_schedule_up_to_pp8_m32_v4_within_10s():
    """Each builder either gives a schedule the validator proves (no deadlock, messages in
    order, every micro-batch once) or refuses it up front, naming the fix."""
    # CPU time, not wall: the bound is the validator's work; a loaded CI machine (8.8 s of wall
    # at load 15 for 2.4 s of CPU) must not fail it.
    t0 = time.process_time()
    proved = refused = 0
    for name, pp, m, v in _shapes():
        try:
            schedule = build_schedule(name, pp, m, v)
        except ValueError as e:
            assert "--microbatches" in str(e) or "--virtual-stages" in str(e), str(e)
            assert name == "interleaved" and (m < pp or m % pp or pp == 1), (name, pp, m, v)
            refused += 1
            continue
        place = placement(name, pp, v)
        validate(schedule, m, place.v, place.v_shape)
        proved += 1
    elapsed = time.process_time() - t0
    assert elapsed < 10, f"{elapsed:.1f} s of CPU"
    # refused: interleaved with m < pp or m % pp (m < pp runs for the others)
    assert proved == 1268 and refused == 780, (proved, refused)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_fewer_microbatches_than_stages_run(name):
    """m < p: proved, and the simulated bubble is the formula's (1F1B with m=1 is a pipeline
    that works on one micro-batch at a time: (p-1)/p idle)."""
    for pp, m in ((4, 1), (4, 3), (8, 5)):
        timing = simulate(build_schedule(name, pp, m), m)
        assert timing.bubble == pytest.approx(bubble_formula(name, pp, m), abs=1e-9)
    assert bubble_formula("1f1b", 4, 1) == pytest.approx(3 / 4)
    assert bubble_formula("zb-h1", 4, 3) < bubble_formula("1f1b", 4, 3)


def test_interleaved_refuses_fewer_microbatches_than_stages_naming_the_fix():
    with pytest.raises(ValueError, match=r"microbatches=3 is fewer than pp=4 stages: interleaved "
                                         r".*--microbatches 4 or more.*--schedule 1f1b"):
        build_schedule("interleaved", 4, 3, 2)


def test_interleaved_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"not a multiple of pp=4.*--microbatches in \[4, 8\]"):
        interleaved(0, 4, 6, 2)
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        interleaved(0, 1, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs --schedule interleaved"):
        build_schedule("1f1b", 2, 4, 2)


# -- bubbles: the simulated step (F = B = W = 1 per full stage) equals each formula -------------
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                    ("interleaved", 3), ("interleaved", 4), ("zb-v", 2)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_simulated_bubble_equals_the_formula(name, v, pp, m):
    cost = {kind: t / v for kind, t in UNIT_COST.items()}  # a chunk is 1/v of a stage
    timing = simulate(build_schedule(name, pp, m, v), m, v, cost, v_shape=name == "zb-v")
    assert timing.bubble == pytest.approx(bubble_formula(name, pp, m, v), abs=1e-9)


def test_goals_of_issue_28_in_the_model():
    """ZB-H1: a third of 1F1B's idle time at 1F1B's peak memory. Interleaved v=2 at p=4, m=8:
    the formula's 16 % shorter step (the issue's 20 % is more than the formula allows)."""
    pp, m = 4, 8
    one = simulate(build_schedule("1f1b", pp, m), m)
    zb = simulate(build_schedule("zb-h1", pp, m), m)
    ideal = 3.0 * m  # F + B + W per micro-batch
    assert (zb.makespan - ideal) == pytest.approx((one.makespan - ideal) / 3)
    assert (max(peak_in_flight(a) for a in build_schedule("zb-h1", pp, m))
            == max(peak_in_flight(a) for a in build_schedule("1f1b", pp, m)) == pp)
    half = {kind: t / 2 for kind, t in UNIT_COST.items()}
    inter = simulate(build_schedule("interleaved", pp, m, 2), m, 2, half)
    assert one.makespan / inter.makespan == pytest.approx((m + pp - 1) / (m + (pp - 1) / 2))


def test_interleaved_chunk_order_and_wraparound():
    # pp=2, v=2: rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3. Rank 0 warms up
    # with (v-1)*pp + 2*(pp-1) = 4 chunk-forwards: mb 0, 1 of chunk 0, then of chunk 1.
    ranks = build_schedule("interleaved", 2, 2, 2)
    forwards = [(a.mb, a.chunk) for a in ranks[0] if isinstance(a, Forward)]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Chunk 1 of rank 0 receives from rank 1's chunk 0 (the wrap-around); chunk 0 does not.
    assert RecvActivation(0, 1) in ranks[0] and RecvActivation(0, 0) not in ranks[0]
    assert SendGrad(0, 1) in ranks[0] and SendGrad(0, 0) not in ranks[0]
    # The last virtual stage (rank 1, chunk 1) computes the loss: nothing to send on.
    assert SendActivation(0, 1) not in ranks[1] and RecvGrad(0, 1) not in ranks[1]
    assert repr(Forward(3, 1)) == "Forward(mb=3, chunk=1)" and repr(Forward(3)) == "Forward(mb=3)"


def test_zb_h1_defers_weight_gradients_on_later_stages_only():
    last = zb_h1(2, 3, 3)  # stage 2 of 3 defers up to 2 W's
    compute = [a for a in last if isinstance(a, (Forward, BackwardInput, BackwardWeight))]
    assert compute[:4] == [Forward(0), BackwardInput(0), Forward(1), BackwardInput(1)]
    first = zb_h1(0, 3, 3)  # stage 0 defers none: W right after its B
    i = first.index(BackwardInput(0))
    assert first[i + 1:i + 3] == [SendGrad(0), BackwardWeight(0)] or first[i + 1] == (
        BackwardWeight(0))


def test_split_backward_errors():
    ok = zb_h1(0, 1, 2)
    validate([ok], 2)
    with pytest.raises(ScheduleError, match=r"runs BackwardWeight\(mb=0\) \(step 1\) before "
                                            r"BackwardInput\(mb=0\)"):
        validate([[Forward(0), BackwardWeight(0), BackwardInput(0), Forward(1), Backward(1)]], 2)
    with pytest.raises(ScheduleError, match="BackwardInput for micro-batches \\[0\\] but "
                                            "BackwardWeight for \\[\\]"):
        validate([[Forward(0), BackwardInput(0), Forward(1), Backward(1)]], 2)
    with pytest.raises(ScheduleError, match="has chunks 0..0"):
        validate([[Forward(0, 1), Backward(0, 1)]], 1)


def test_interleaved_two_ranks_message_order_is_checked_per_kind():
    """pp=2: rank 0 sends rank 1 both activations (chunk 0) and gradients (chunk 1). They travel
    under different tags, so only each kind's own order must match."""
    ranks = build_schedule("interleaved", 2, 4, 2)
    validate(ranks, 4, 2)
    swapped = list(ranks[1])
    i, j = swapped.index(RecvActivation(0, 0)), swapped.index(RecvActivation(1, 0))
    swapped[i:i + 3], swapped[j:j + 3] = swapped[j:j + 3], swapped[i:i + 3]  # recv, F, send
    with pytest.raises(ScheduleError, match="order mismatch: stage 1 expects "
                                            r"RecvActivation\(mb=1\)"):
        validate([ranks[0], swapped], 4, 2)


# -- ZB-V: two chunks per rank in a V ----------------------------------------------------------
def test_v_placement_goes_down_the_ranks_and_back_up():
    place = placement("zb-v", 4)
    assert [place.stage(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(place.where(place.stage(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    assert place.local(3, 0, 1) == 1 and place.local(3, 1, -1) == 0  # the V's bottom
    assert place.local(2, 0, 1) is None and place.neighbour(0, 1, 1) is None  # rank 0: last
    assert placement("interleaved", 4, 2).stage(1, 1) == 5


def test_zb_v_bottom_hands_over_without_messages_and_goals_of_issue_28():
    """The last rank passes stage pp-1 to pp within itself; F B W in the steady state; idle
    one chunk's forward per rank: a sixth of 1F1B's (the least a 2-chunk schedule can idle:
    the last rank starts after pp-1 chunk-forwards; the issue's 1/10 is below that bound), at
    1F1B's peak activation memory (2 pp half-stage chunks = pp stages)."""
    pp, m = 4, 8
    bottom = zb_v(pp - 1, pp, m)
    assert not any(isinstance(a, (SendActivation, RecvGrad)) and a.chunk == 0 for a in bottom)
    assert not any(isinstance(a, (RecvActivation, SendGrad)) and a.chunk == 1 for a in bottom)
    first = zb_v(0, pp, m)  # rank 0: stage 0 and the last stage, which computes the loss
    assert RecvActivation(0, 1) in first and SendActivation(0, 1) not in first
    half = {kind: t / 2 for kind, t in UNIT_COST.items()}
    zbv = simulate(build_schedule("zb-v", pp, m), m, 2, half, v_shape=True)
    one = simulate(build_schedule("1f1b", pp, m), m)
    ideal = 3.0 * m
    assert (zbv.makespan - ideal) == pytest.approx((one.makespan - ideal) / 6)
    assert max(peak_in_flight(a) for a in build_schedule("zb-v", pp, m)) == 2 * pp
    # m < 2pp-1: the weight passes cannot fill the warm-up; the formula is the simulated figure
    few = simulate(build_schedule("zb-v", pp, 3), 3, 2, half, v_shape=True)
    assert bubble_formula("zb-v", pp, 3) == few.bubble > (pp - 1) / (6 * 3 + pp - 1)
    with pytest.raises(ValueError, match="virtual_stages=3: zb-v holds 2 chunks per rank"):
        build_schedule("zb-v", pp, m, 3)


def test_v_bottom_message_is_rejected():
    ranks = build_schedule("zb-v", 2, 3)
    i = ranks[1].index(Forward(0, 1))
    ranks[1].insert(i, RecvActivation(0, 1))
    with pytest.raises(ScheduleError, match=r"RecvActivation\(mb=0, chunk=1\) \(step \d+\) but its "
                                            "previous stage is its own chunk 0"):
        validate(ranks, 3, 2, v_shape=True)
    with pytest.raises(ScheduleError, match="before"):  # a loop placement needs messages there
        validate(build_schedule("zb-v", 2, 3), 3, 2)
