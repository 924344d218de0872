"""A worker's first step under `--memory-limit`: join its memory cgroup, then become the worker.

    python -u memory_exec.py train ARGS...    # (torch's agent runs this, one per LOCAL_RANK)

Run as a script, before anything is imported: memory a process allocated before it joined a
cgroup stays charged where it was, so the worker joins `$RINGTRAIN_MEMORY_CGROUP/rank{LOCAL_RANK}`
first and only then execs `python -u -m ringtrain ARGS` (same pid, same cgroup); a live job's
warm spare joins the cgroup of its own that `$RINGTRAIN_MEMORY_SLOT` names instead. Only the
standard library here: this file is not imported as part of ringtrain. See `cgroup.py`.
"""

import os
import sys


def main() -> None:
    slot = os.environ.get("RINGTRAIN_MEMORY_SLOT") or f"rank{os.environ['LOCAL_RANK']}"
    target = os.path.join(os.environ["RINGTRAIN_MEMORY_CGROUP"], slot)
    with open(os.path.join(target, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    # glibc raises its mmap threshold as large blocks are freed, after which freed tensors stay
    # in its heap: the cgroup would charge memory the worker no longer uses. A fixed threshold
    # (which turns that off) returns every freed tensor over 1 MiB to the kernel.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    os.execv(sys.executable, [sys.executable, "-u", "-m", "ringtrain", *sys.argv[1:]])


if __name__ == "__main__":
    main()
