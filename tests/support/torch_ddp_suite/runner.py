"""Run named tests of torch's DDP suite with a chosen DDP class; one verdict per (test, class).

    verdicts = run_tests(["test_ddp_logging_data_cpu"], ddp=("torch", "ringtrain"))

The tests run in a runner subprocess (`python -m tests.support.torch_ddp_suite.runner ...`): it
imports distributed_test under the skip patches, which must not leak into the caller (pytest),
and a fresh process owns its forkserver (preloaded with the suite) whatever the caller started
before. The runner prints one JSON line per verdict as it goes. It never hangs the caller: each
test has `timeout_s` (torch's own join loop, then SIGKILL), and a runner that gives no verdict
for longer loses its whole process group (runner, forkserver, ranks); the test it was on is
`timeout` and a new runner goes on with the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
STARTUP_S = 120.0  # importing torch's test suite twice (runner and forkserver) on a loaded box
GRACE_S = 60.0  # past a test's timeout: torch's join loop asks hung ranks for stacks, then kills
ERROR_LINES = 4


@dataclass(frozen=True)
class Verdict:
    """One test under one DDP class: `pass`, `fail`, `skip` or `timeout`, and why."""

    name: str
    ddp: str
    verdict: str
    seconds: float
    error: str = ""  # fail/timeout: the exception's first lines per rank; skip: the reason


def summarize(text: str) -> str:
    """The exception lines of each rank's traceback in torch's report (not the stack).

    torch's report is "Process R exited with error code 10 and exception:\\n<traceback>" per
    failed rank; a traceback's exception starts after its last frame (`  File "..."` and the
    frame's indented source lines). Whitespace runs collapse, so a tensor in a message stays short.
    """
    parts = re.split(r"(Process \d+) exited with error code \d+ and exception:\n", text)
    sections = list(zip(parts[1::2], parts[2::2], strict=True)) or [("", text)]
    out = []
    for rank, body in sections:
        lines = body.rstrip().splitlines()
        start = max((i for i, line in enumerate(lines) if line.startswith('  File "')),
                    default=-1) + 1
        while start < len(lines) and lines[start].startswith("    "):
            start += 1  # the frame's source line and its ^^^ marker
        tail = [line.strip() for line in lines[start:] if line.strip()][:ERROR_LINES]
        message = re.sub(r"\s+", " ", " | ".join(tail))[:300]
        if message:
            out.append(f"{rank}: {message}" if rank else message)
    return " || ".join(out)


def _verdict(result: unittest.TestResult) -> tuple[str, str]:
    if result.skipped:
        return "skip", result.skipped[0][1]
    problems = result.errors + result.failures + [(t, "unexpected success")
                                                  for t in result.unexpectedSuccesses]
    if not problems:
        return "pass", ""
    text = problems[0][1]
    if re.search(r"terminated or timed out after", text):
        return "timeout", summarize(text)
    return "fail", summarize(text)


def _run_here(todo: list[tuple[str, str]], timeout_s: float, spawned: bool) -> None:
    """In the runner process: run each (test, class) of `todo` in order, print a JSON line per
    verdict."""
    import multiprocessing.forkserver

    if not spawned:  # the server imports the suite while this process does, not after it
        multiprocessing.forkserver.set_forkserver_preload([f"{__package__}.cases"])
        multiprocessing.forkserver.ensure_running()
    from torch.testing._internal import common_distributed

    from .cases import case_class

    # torch's join loop times a test out at get_timeout(test_id) (300 s as shipped).
    common_distributed.get_timeout = lambda test_id: timeout_s
    for name, ddp in todo:
        result = unittest.TestResult()
        start = time.monotonic()
        try:
            case_class(ddp, spawned)(name).run(result)
            verdict, error = _verdict(result)
        except Exception as e:  # noqa: BLE001 - the harness itself broke: say so, go on
            verdict, error = "fail", f"harness: {type(e).__name__}: {e}"
        v = Verdict(name, ddp, verdict, round(time.monotonic() - start, 2), error)
        print(json.dumps(asdict(v)), flush=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)  # closed: the runner exited or was killed


def run_tests(names: list[str], ddp: tuple[str, ...] = ("torch", "ringtrain"), *,
              timeout_s: float = 90.0, spawned: bool = False, retarget: bool = True,
              log: Path | None = None, on_verdict=None) -> list[Verdict]:
    """Run `names` under each class of `ddp` in a runner subprocess; return every verdict.

    Args:
        names: test method names of `DistributedTest._DistTestBase`.
        ddp: the DDP classes to run each test with, in order: "torch" and/or "ringtrain".
        timeout_s: per test and class; past it the ranks are killed and the verdict is timeout.
        spawned: start ranks as torch's test_distributed_spawn.py does (slow), not forked.
        retarget: apply the CPU retargeting (retarget.py); False runs the tests as shipped.
        log: where the runner's stderr (ranks' logs and tracebacks) goes; a temp file if None.
        on_verdict: called with each Verdict as it arrives (progress output).

    A verdict is due within `timeout_s` + GRACE_S of the previous one (STARTUP_S more for the
    first): torch's join loop kills a hung test's ranks at `timeout_s`. If the runner itself
    stops answering or dies, its process group goes (runner, forkserver, ranks), the test it
    was on gets `timeout` or `fail`, and a new runner takes the tests after it.
    """
    return run_pairs([(n, d) for n in names for d in ddp], timeout_s=timeout_s,
                     spawned=spawned, retarget=retarget, log=log, on_verdict=on_verdict)


def run_pairs(todo: list[tuple[str, str]], *, timeout_s: float = 90.0, spawned: bool = False,
              retarget: bool = True, log: Path | None = None, on_verdict=None) -> list[Verdict]:
    """`run_tests` on exactly the (test name, DDP class) pairs of `todo`, in order: tests
    wanted under one class and tests wanted under both share a runner (its start imports torch's
    test suite twice, in the runner and its forkserver)."""
    verdicts: list[Verdict] = []
    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as log_file:
        while todo:
            got, answered = _one_runner(todo, timeout_s, spawned, retarget, log_file, on_verdict)
            verdicts += got
            done = {(v.name, v.ddp) for v in got}
            todo = [t for t in todo if t not in done]
            if todo and not answered:  # it cannot start (an import failed): say why, once
                error = f"harness: the runner gave no verdict: {_tail(log_file)}"
                verdicts += [Verdict(n, d, "fail", 0.0, error) for n, d in todo]
                break
    return verdicts


def _tail(log_file, chars: int = 600) -> str:
    log_file.flush()
    end = log_file.seek(0, os.SEEK_END)
    log_file.seek(max(0, end - chars))
    return " ".join(log_file.read().split())


def runner_command(todo: list[tuple[str, str]], timeout_s: float, spawned: bool) -> list[str]:
    return [sys.executable, "-m", "tests.support.torch_ddp_suite.runner", "--timeout",
            str(timeout_s), *(["--spawned"] if spawned else []), *(f"{n}@{d}" for n, d in todo)]


def _one_runner(todo, timeout_s, spawned, retarget, log_file, on_verdict
                ) -> tuple[list[Verdict], bool]:
    """Run `todo` in one runner until it finishes or stops answering.

    Returns the verdicts and whether the runner got as far as running tests: one that exits
    before its first verdict (an import failed) has run none, and a new one would fail the same.
    """
    wanted = set(todo)
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
           "RINGTRAIN_TORCH_SUITE_RETARGET": "1" if retarget else "0",
           "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.Popen(runner_command(todo, timeout_s, spawned), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=log_file, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    got: list[Verdict] = []
    due = time.monotonic() + STARTUP_S + timeout_s + GRACE_S
    why = ""
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                why = f"the runner gave no verdict within {timeout_s + GRACE_S:g} s: killed"
                break
            if line is None:
                proc.wait()
                why = f"the runner exited with code {proc.returncode}; see the log"
                break
            if not line.startswith("{"):
                continue  # torch prints progress ("Process 1 terminated with exit code 10 ...")
            v = Verdict(**json.loads(line))
            due = time.monotonic() + timeout_s + GRACE_S
            if (v.name, v.ddp) in wanted:
                got.append(v)
                if on_verdict:
                    on_verdict(v)
    finally:
        _kill_group(proc.pid)  # the forkserver and any rank left over, or all of it on a hang
        proc.wait()
    answered = bool(got) or "no verdict" in why  # hung on a test, or crashed on one
    done = {(v.name, v.ddp) for v in got}
    rest = [t for t in todo if t not in done]
    if rest and why and answered:  # the test the runner was on when it stopped answering or died
        name, d = rest[0]
        verdict = "timeout" if "no verdict" in why else "fail"
        got.append(Verdict(name, d, verdict, timeout_s, f"harness: {why}"))
        if on_verdict:
            on_verdict(got[-1])
    return got, answered


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", help="NAME (under every --ddp class) or NAME@CLASS")
    p.add_argument("--ddp", default="torch,ringtrain")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--spawned", action="store_true")
    args = p.parse_args(argv)
    ddps = args.ddp.split(",")
    todo = [pair for n in args.names
            for pair in ([tuple(n.split("@", 1))] if "@" in n else [(n, d) for d in ddps])]
    _run_here(todo, args.timeout, args.spawned)


if __name__ == "__main__":
    main()
