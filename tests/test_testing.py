"""The test helpers of `ringtrain.testing`: fault injection lives there, not in production code.

    .venv/bin/pytest -q tests/test_testing.py

`run_workers` is exercised by every multi-process test; here: `fault_hook`
(RINGTRAIN_TEST_FAULT=ACTION:RANK:STEP), called as `ringtrain train` calls it, in this process.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import ringtrain
from ringtrain.testing import fault_hook

PACKAGE = Path(ringtrain.__file__).parent


def test_production_modules_hold_only_the_hook_point():
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("testing.py", "train.py", "chaos.py"):  # chaos.py: the test-only schedule
            continue
        text = path.read_text()
        assert "TEST_FAULT" not in text and "fault_hook" not in text, path
    train = (PACKAGE / "cli" / "train.py").read_text()
    assert "with_test_fault" not in train and "term-launcher" not in train
    mentions = [line.strip() for line in train.splitlines() if "RINGTRAIN_TEST_FAULT" in line]
    # The one hook point: `if "RINGTRAIN_TEST_FAULT" in os.environ:`, then ringtrain.testing.
    assert len(mentions) == 1 and mentions[0].startswith('if "RINGTRAIN_TEST_FAULT" in os.environ:')
    assert "from ringtrain.testing import fault_hook" in train
    assert "fault_hook(trainer.on_step, rt.rank)" in train


@pytest.fixture
def fault_env(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return lambda spec: monkeypatch.setenv("RINGTRAIN_TEST_FAULT", spec)


def test_no_fault_leaves_on_step_alone(fault_env, monkeypatch):
    def on_step(step):
        return None

    monkeypatch.delenv("RINGTRAIN_TEST_FAULT", raising=False)
    assert fault_hook(on_step, 0) is on_step
    fault_env("term:1:2")
    assert fault_hook(on_step, 0) is on_step  # another rank's fault
    assert fault_hook(None, 0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job runs through
    assert fault_hook(on_step, 1) is on_step


def test_a_wrong_spec_names_the_variable_and_the_choices(fault_env):
    fault_env("kill:1")
    with pytest.raises(ValueError, match=r"RINGTRAIN_TEST_FAULT='kill:1': expected ACTION:RANK:STEP"):
        fault_hook(None, 1)
    fault_env("explode:1:2")
    with pytest.raises(ValueError, match="ACTION is one of kill, term, term-launcher, int"):
        fault_hook(None, 1)


def test_term_after_the_step_on_the_named_rank(fault_env, capsys):
    fault_env("term:1:2")
    seen, received = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        hook = fault_hook(seen.append, 1)
        for step in range(1, 4):
            hook(step)
            assert received == ([signal.SIGTERM] if step >= 2 else [])  # right after step 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [1, 2, 3] and received == [signal.SIGTERM]  # the wrapped on_step still runs
    assert "[rank 1] test fault: term after step 2 at unix time" in capsys.readouterr().err
