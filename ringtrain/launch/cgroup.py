"""A memory limit per worker, enforced by the kernel: one memory cgroup per local rank.

    ringtrain train --nproc-per-node 2 --memory-limit 1.2G ...     # each worker at most 1.2 GiB

The process that launches the workers (root, or a delegated cgroup) creates
`<memory root>/ringtrain-<pid>-<id>/rank{0..N-1}`, each with the limit (cgroup v2
`memory.max` and `memory.swap.max = 0`; cgroup v1 `memory.limit_in_bytes` and
`memory.memsw.limit_in_bytes`), and starts each worker through `memory_exec.py`, which moves
itself into `rank{LOCAL_RANK}` and only then execs Python: every byte the worker ever touches
(torch's own ~300 MB included) is charged to its cgroup, since charges made before joining do
not move with a process.
A live job's warm spare (`ringtrain train --live --live-spares N`) gets a cgroup of its own,
`spare{n}`, with the same limit (`add_spare`; memory_exec.py joins the one `SLOT_ENV` names),
and stays in it when it takes a lost worker's place: moved into that worker's `rank{i}` then,
the model copy it built while waiting would stay charged to `spare{n}` (charges do not move),
so it could use twice the limit; in one cgroup from its start, it is bounded once, as a worker
is. (Sharing a running worker's cgroup while it waits would let the spare's model copy push
that worker over its limit.) The report names each spare's cgroup beside the ranks'.
A worker over its limit is killed by the kernel's OOM killer (SIGKILL); torch's agent stops
the others (nothing hangs), and `report` reads each cgroup's OOM kill count (v2
`memory.events`, v1 `memory.oom_control`) to say so, naming the limit. The cgroups are removed
afterwards. Where no memory cgroup can be made (no controller, read-only, not root)
`CgroupUnavailable` says why.

Tests: `.venv/bin/pytest -q tests/test_memory_limit.py`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV = "RINGTRAIN_MEMORY_CGROUP"  # the parent cgroup's path, for memory_exec.py in each worker
SLOT_ENV = "RINGTRAIN_MEMORY_SLOT"  # a spare's own cgroup under it (else rank{LOCAL_RANK})
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be created here; the message says why."""


def parse_size(text: str) -> int:
    """Bytes from '1.5G', '700M', '800MiB' or '1000000' (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 1.5G, 700M or 800000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _is_cgroup2_with_memory(path: Path) -> bool:
    try:
        return "memory" in (path / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def memory_root(base: Path = Path("/sys/fs/cgroup")) -> tuple[int, Path]:
    """(cgroup version, directory new memory cgroups go in); raises `CgroupUnavailable`."""
    candidates = [(2, base), (2, base / "unified"), (1, base / "memory")]
    reasons = []
    for version, path in candidates:
        ok = (_is_cgroup2_with_memory(path) if version == 2
              else (path / "memory.limit_in_bytes").is_file())
        if not ok:
            reasons.append(f"{path}: no memory controller")
            continue
        if not os.access(path, os.W_OK):
            reasons.append(f"{path}: not writable (run as root, or delegate a cgroup)")
            continue
        return version, path
    raise CgroupUnavailable("no writable memory cgroup: " + "; ".join(reasons))


@dataclass
class MemoryCgroups:
    """`count` sibling cgroups `rank{i}`, each limited to `limit` bytes, under `path`."""

    path: Path
    version: int
    limit: int
    count: int

    @classmethod
    def create(cls, limit: int, count: int, base: Path = Path("/sys/fs/cgroup")) -> MemoryCgroups:
        version, root = memory_root(base)
        path = root / f"ringtrain-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        made = cls(path, version, limit, count)
        try:
            if version == 2:  # children get the memory controller from their parent
                _write(root / "cgroup.subtree_control", "+memory")
            path.mkdir()
            if version == 2:
                _write(path / "cgroup.subtree_control", "+memory")
            for r in range(count):
                made._limited(made.rank_dir(r))
        except OSError as e:
            made.remove()
            raise CgroupUnavailable(f"cannot set up memory cgroups under {root}: {e}") from None
        return made

    def _limited(self, d: Path) -> None:
        d.mkdir()
        if self.version == 2:
            _write(d / "memory.max", str(self.limit))
            _write(d / "memory.swap.max", "0")  # over the limit means killed, not swapped
        else:
            _write(d / "memory.limit_in_bytes", str(self.limit))
            with contextlib.suppress(OSError):  # absent without swap accounting
                _write(d / "memory.memsw.limit_in_bytes", str(self.limit))

    def rank_dir(self, local_rank: int) -> Path:
        return self.path / f"rank{local_rank}"

    def add_spare(self, n: int) -> str:
        """A cgroup `spare{n}` with the workers' limit, for a live job's n-th warm spare; its
        name (the spare's `SLOT_ENV`). Raises `CgroupUnavailable` where it cannot be made."""
        name = f"spare{n}"
        try:
            self._limited(self.path / name)
        except OSError as e:
            raise CgroupUnavailable(f"cannot make {self.path / name}: {e}") from None
        return name

    def spares(self) -> list[str]:
        """The spares' cgroups made so far, in the order they were made."""
        found = [p.name for p in self.path.glob("spare*") if p.name[5:].isdigit()]
        return sorted(found, key=lambda name: int(name[5:]))

    def _stat(self, d: Path, name: str, key: str) -> int:
        try:
            for line in (d / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def _dirs(self, spares: bool) -> list[Path]:
        ranks = [self.rank_dir(r) for r in range(self.count)]
        return ranks + [self.path / name for name in self.spares()] if spares else ranks

    def oom_kills(self, spares: bool = False) -> list[int]:
        """Processes the OOM killer ended in each rank's cgroup (then each spare's)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return [self._stat(d, name, "oom_kill") for d in self._dirs(spares)]

    def peaks(self, spares: bool = False) -> list[int | None]:
        """Each rank's (then each spare's) peak memory usage in bytes, where the kernel keeps
        it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        out: list[int | None] = []
        for d in self._dirs(spares):
            try:
                out.append(int((d / name).read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                out.append(None)
        return out

    def remove(self) -> None:
        """Remove the cgroups (after the workers exited; a straggler is moved out first)."""
        parent = self.path.parent / "cgroup.procs"
        for d in self._dirs(spares=True):
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    _write(parent, pid)
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class WorkerMemoryLimit:
    """What `ringtrain train` launches its workers through, with or without a limit."""

    def __init__(self, cgroups: MemoryCgroups | None):
        self.cgroups = cgroups
        # memory_exec.py joins the rank's cgroup, then execs `python -u -m ringtrain ...`.
        self.entrypoint = (str(Path(__file__).with_name("memory_exec.py")) if cgroups
                           else "ringtrain")
        self.module = cgroups is None

    def report(self, exit_code: int) -> int:
        """After the launcher returned: name each worker the OOM killer ended, and the limit."""
        if self.cgroups is None:
            return exit_code
        c = self.cgroups
        names = [f"rank {r}" for r in range(c.count)] + [f"spare {n[5:]}" for n in c.spares()]
        kills, peaks = c.oom_kills(spares=True), c.peaks(spares=True)
        knob = "memory.max" if c.version == 2 else "memory.limit_in_bytes"
        if any(kills):
            ranks = [r for r, k in enumerate(kills[:c.count]) if k]
            spares = [names[i] for i in range(c.count, len(names)) if kills[i]]
            which = (f"worker{'s' if len(ranks) > 1 else ''} of local rank "
                     f"{', '.join(map(str, ranks))}" if ranks else "")
            if spares:  # a spare's own cgroup: waiting, or in a lost worker's place since
                which += (" and " if which else "") + f"the live {', '.join(spares)}"
            print(f"ringtrain train: error: out of memory: the kernel's OOM killer ended {which} "
                  f"(SIGKILL): each worker may use at most --memory-limit {human(c.limit)} "
                  f"({c.limit} bytes, cgroup v{c.version} {knob}) and this run needs more. Use "
                  "--strategy zero --zero-stage 3 (16/N bytes per parameter), more workers, "
                  "--activation-checkpointing, or a higher --memory-limit", file=sys.stderr,
                  flush=True)
            return exit_code or 137
        shown = ", ".join(f"{n} {human(p)}" for n, p in zip(names, peaks, strict=True)
                          if p is not None)
        print(f"ringtrain train: peak memory per worker under --memory-limit {human(c.limit)}: "
              f"{shown or 'not reported by this kernel'}", file=sys.stderr, flush=True)
        return exit_code


@contextlib.contextmanager
def worker_memory_limit(limit: str | int | None,
                        nproc_per_node: int) -> Iterator[WorkerMemoryLimit]:

    """Per-worker memory cgroups for the launch inside (none when `limit` is None); removed after.

    Raises `CgroupUnavailable` (why) when a limit is asked for and cannot be enforced.
    """
    if limit is None:
        yield WorkerMemoryLimit(None)
        return
    cgroups = MemoryCgroups.create(parse_size(str(limit)), nproc_per_node)
    os.environ[ENV] = str(cgroups.path)
    try:
        yield WorkerMemoryLimit(cgroups)
    finally:
        os.environ.pop(ENV, None)
        cgroups.remove()
