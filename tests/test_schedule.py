"""Pipeline schedules as data (`ringtrain.pipeline.schedule`): pure, no processes.

    .venv/bin/pytest -q tests/test_schedule.py
"""

import pytest

from ringtrain.pipeline.schedule import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    validate,
)


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


def test_fewer_microbatches_than_stages_is_an_error():
    with pytest.raises(ValueError, match=r"microbatches=2 is fewer than pp=4 .*--microbatches 4"):
        one_f_one_b(0, 4, 2)
    with pytest.raises(ValueError, match="schedule='zigzag' is not known"):
        build_schedule("zigzag", 2, 4)
