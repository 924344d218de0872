"""A worker's first step under `--memory-limit`: join its memory cgroup, then become the worker.

    python -u memory_exec.py train ARGS...    # (torch's agent runs this, one per LOCAL_RANK)

Run as a script, before anything is imported: memory a process allocated before it joined a
cgroup stays charged where it was, so the worker joins `$RINGTRAIN_MEMORY_CGROUP/rank{LOCAL_RANK}`
first and only then execs `python -u -m ringtrain ARGS` (same pid, same cgroup); a live job's
warm spare joins the cgroup of its own that `$RINGTRAIN_MEMORY_SLOT` names instead. Never forked
from a warm process (`starts.py`): pages shared with it would be charged to its cgroup. Only
the standard library here: run as a script, it runs before any of ringtrain is imported. See
`cgroup.py`.
"""

import os
import sys

# glibc raises its mmap threshold as large blocks are freed, after which freed tensors stay in
# its heap: the cgroup would charge memory the worker no longer uses. A fixed threshold (which
# turns that off) returns every freed tensor over 1 MiB to the kernel. Read when glibc starts.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def cgroup_procs(env) -> str:
    """The `cgroup.procs` file of the cgroup a worker with environment `env` joins."""
    slot = env.get("RINGTRAIN_MEMORY_SLOT") or f"rank{env['LOCAL_RANK']}"
    return os.path.join(env["RINGTRAIN_MEMORY_CGROUP"], slot, "cgroup.procs")


def main() -> None:
    with open(cgroup_procs(os.environ), "w") as f:
        f.write(str(os.getpid()))
    for name, value in MALLOC_ENV.items():
        os.environ.setdefault(name, value)
    os.execv(sys.executable, [sys.executable, "-u", "-m", "ringtrain", *sys.argv[1:]])


if __name__ == "__main__":
    main()
