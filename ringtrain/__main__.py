"""`python -m ringtrain ...`: how `ringtrain train` relaunches itself on each worker."""

import os
import sys
import traceback

from ringtrain.cli import main


def _run_and_end() -> None:
    """Run the command; a launched worker then ends at once, its results and output flushed.

    Everything a worker must leave behind (summary.json, report.png, snapshots, metrics) is
    written and fsynced before `main` returns, and the process group is torn down. What
    remains is interpreter shutdown, in which a communication thread of torch's can still
    abort the process (SIGABRT) and turn a finished run into a failed one: a worker skips it.
    """
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported like the interpreter would, then ended
        traceback.print_exc()
        code = 1
    if "LOCAL_RANK" not in os.environ:  # not a launched worker: an ordinary exit
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_run_and_end()
