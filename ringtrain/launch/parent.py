"""A worker dies with its launcher: nothing is left running after a SIGKILLed `ringtrain run`.

    from ringtrain.launch.parent import die_with_parent
    die_with_parent()      # first thing in a worker

Its own module so that a worker asks the kernel for this without importing the launcher (and
torch's elastic agent with it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from ringtrain.launch.environments import LAUNCHER_PID_ENV

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Have the kernel send `signum` to this process when its parent (the launcher) dies.

    Call it first thing in a worker: a SIGKILLed launcher runs no cleanup, and without this
    its workers would keep running (and holding GPUs) as orphans. Linux only; no-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    # The launcher may have died between our fork and the prctl call: then nobody will signal us.
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        os.kill(os.getpid(), signum)
