"""RINGTRAIN_STEP_HOOK=MODULE:FUNCTION (`ringtrain/cli/step_hook.py`): the one hook point of
`ringtrain train` for per-step callbacks, by which the tests' faults come in.

    .venv/bin/pytest -q tests/test_step_hook.py

End to end it is exercised by every test that injects a fault (tests/test_restart.py,
tests/test_errors.py's Ctrl-C); here: the loader's contract and its messages, in this process.
"""

from __future__ import annotations

import pytest

from ringtrain.cli.step_hook import load_step_hook
from ringtrain.errors import ConfigError


def test_unset_or_empty_imports_nothing():
    assert load_step_hook(None) is None and load_step_hook("") is None


@pytest.mark.parametrize("value", ["faults", "faults:", ":hook", "faults:hook:x", "a:b c"])
def test_a_value_of_another_form_names_the_variable_the_value_and_the_form(value):
    with pytest.raises(ConfigError) as e:
        load_step_hook(value)
    assert str(e.value) == (f"RINGTRAIN_STEP_HOOK={value!r}: expected MODULE:FUNCTION, a function "
                            "(on_step, rank) -> on_step on PYTHONPATH, e.g. myhooks:wrap")


def test_a_module_or_function_that_is_not_there_is_named():
    with pytest.raises(ConfigError, match=r"RINGTRAIN_STEP_HOOK='no_such_module_x:wrap': cannot "
                                          r"import no_such_module_x \(No module named"):
        load_step_hook("no_such_module_x:wrap")
    with pytest.raises(ConfigError, match=r"'os.path:nope': os.path has no function nope; "
                                          "expected MODULE:FUNCTION"):
        load_step_hook("os.path:nope")


def test_the_function_wraps_on_step_and_what_it_returns_is_checked(monkeypatch, tmp_path):
    (tmp_path / "myhooks.py").write_text(
        "def wrap(on_step, rank):\n"
        "    def each(step):\n"
        "        on_step(step)\n"
        "        on_step(step * 10 + rank)\n"
        "    return each if rank == 1 else on_step\n"
        "def broken(on_step, rank):\n"
        "    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    wrapped = load_step_hook("myhooks:wrap")(seen.append, 1)
    wrapped(2)
    assert seen == [2, 21]
    assert load_step_hook("myhooks:wrap")(seen.append, 0) == seen.append  # left alone
    with pytest.raises(TypeError, match=r"'myhooks:broken' returned 3 on rank 0; expected a "
                                        r"function step -> None \(or None\)"):
        load_step_hook("myhooks:broken")(None, 0)
