"""The test helpers: `ringtrain.testing.run_workers`, and the fault injection of tests/support.

    .venv/bin/pytest -q tests/test_testing.py

`run_workers` is exercised by every multi-process test; here: `support/faults.py`'s `hook`
(RINGTRAIN_TEST_FAULT=ACTION:RANK:STEP), called as `ringtrain train` calls a
RINGTRAIN_STEP_HOOK, in this process, and `fault_env`, the variables a subprocess needs.
"""

from __future__ import annotations

import os
import signal

import pytest
from support.faults import SUPPORT, fault_env, hook


def test_fault_env_names_the_hook_and_puts_this_folder_on_the_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = fault_env("kill:1:5")
    assert env["RINGTRAIN_TEST_FAULT"] == "kill:1:5" and env["RINGTRAIN_STEP_HOOK"] == "faults:hook"
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(SUPPORT) and (SUPPORT / "faults.py").exists() and path[-1] == "/elsewhere"


@pytest.fixture
def set_fault(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return lambda spec: monkeypatch.setenv("RINGTRAIN_TEST_FAULT", spec)


def test_no_fault_leaves_on_step_alone(set_fault, monkeypatch):
    def on_step(step):
        return None

    monkeypatch.delenv("RINGTRAIN_TEST_FAULT", raising=False)
    assert hook(on_step, 0) is on_step
    set_fault("term:1:2")
    assert hook(on_step, 0) is on_step  # another rank's fault
    assert hook(None, 0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job runs through
    assert hook(on_step, 1) is on_step


def test_a_wrong_spec_names_the_variable_and_the_choices(set_fault):
    set_fault("kill:1")
    with pytest.raises(ValueError,
                       match=r"RINGTRAIN_TEST_FAULT='kill:1': expected ACTION:RANK:STEP"):
        hook(None, 1)
    set_fault("explode:1:2")
    with pytest.raises(ValueError, match="ACTION is one of kill, kill-next, stop, term, "
                       "term-launcher, int, raise"):
        hook(None, 1)


def test_term_after_the_step_on_the_named_rank(set_fault, capsys):
    set_fault("term:1:2")
    seen, received = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        fault = hook(seen.append, 1)
        for step in range(1, 4):
            fault(step)
            assert received == ([signal.SIGTERM] if step >= 2 else [])  # right after step 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [1, 2, 3] and received == [signal.SIGTERM]  # the wrapped on_step still runs
    assert "[rank 1] test fault: term after step 2 at unix time" in capsys.readouterr().err
