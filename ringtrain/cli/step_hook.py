"""RINGTRAIN_STEP_HOOK=MODULE:FUNCTION: your function around every step of `ringtrain train`.

    RINGTRAIN_STEP_HOOK=myhooks:wrap PYTHONPATH=. ringtrain train --nproc-per-node 2

Each worker imports MODULE (it must be on the worker's `sys.path`: PYTHONPATH) and calls
`FUNCTION(on_step, rank)` once, after the watchdog has taken its place; the trainer then calls
what it returns with each finished step's number, on the training loop's thread. `on_step` is
the callback already there (the watchdog's `set_step`, or None): call it first, or return it
unchanged on ranks the hook leaves alone. The hook may return None to call nothing.

Custom per-step callbacks and fault injection come in through it: the tests' faults
(`tests/support/faults.py`, `RINGTRAIN_STEP_HOOK=faults:hook`) live outside the package, and
nothing is imported when the variable is unset.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ringtrain.errors import ConfigError

STEP_HOOK_ENV = "RINGTRAIN_STEP_HOOK"
EXPECTED = "MODULE:FUNCTION, a function (on_step, rank) -> on_step on PYTHONPATH, e.g. myhooks:wrap"

OnStep = Callable[[int], None]
StepHook = Callable[[OnStep | None, int], OnStep | None]


def load_step_hook(value: str | None) -> StepHook | None:
    """The hook RINGTRAIN_STEP_HOOK names (`value`), imported; None when unset or empty.

    Args:
        value: the variable's value, MODULE:FUNCTION (MODULE may be dotted).

    Raises:
        ConfigError: a value not of that form, a module that cannot be imported, a FUNCTION
            it does not hold; each names the variable, the value and the expected form.
    """
    if not value:
        return None
    module_name, _, name = value.partition(":")
    if not module_name or not name.isidentifier():
        raise ConfigError(f"{STEP_HOOK_ENV}={value!r}: expected {EXPECTED}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{STEP_HOOK_ENV}={value!r}: cannot import {module_name} ({e}); "
                          f"expected {EXPECTED}") from None
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ConfigError(f"{STEP_HOOK_ENV}={value!r}: {module_name} has no function {name}; "
                          f"expected {EXPECTED}")

    def checked(on_step: OnStep | None, rank: int) -> OnStep | None:
        wrapped = hook(on_step, rank)
        if wrapped is not None and not callable(wrapped):
            raise TypeError(f"{STEP_HOOK_ENV}={value!r} returned {wrapped!r} on rank {rank}; "
                            "expected a function step -> None (or None)")
        return wrapped
    return checked
