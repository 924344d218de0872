"""How a worker process ends: its command's exit code as the interpreter would give it, then
an exit that skips interpreter shutdown (`python -m ringtrain`'s workers, and every process a
warm process forked, `zygote_server.py`). Only the standard library: the warm process imports
it before any fork.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def exit_code(command: Callable[[], object]) -> int:
    """Run `command`; its exit code as `python` would give it: its int result (else 0), a
    SystemExit's code (a message printed to stderr, code 1), 1 with the traceback for a raise."""
    try:
        result = command()
    except SystemExit as e:
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - reported like the interpreter would, then ended
        if not getattr(e, "ringtrain_printed", False):  # `ringtrain train`: printed once already
            traceback.print_exc()
        return 1
    return result if isinstance(result, int) else 0


def end_now(code: int) -> None:
    """Flush stdout and stderr and exit with `code` at once, skipping interpreter shutdown
    (atexit handlers, module teardown): what a process must leave behind is on disk by now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
