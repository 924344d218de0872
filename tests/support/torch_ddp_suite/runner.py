"""Run named tests of torch's DDP suite with a chosen DDP class; one verdict per (test, class).

    verdicts = run_tests(["test_ddp_logging_data_cpu"], ddp=("torch", "ringtrain"))

The tests run in a runner subprocess (`python -m tests.support.torch_ddp_suite.runner ...`): it
imports distributed_test under the skip patches, which must not leak into the caller (pytest),
and a fresh process owns its forkserver (preloaded with the suite) whatever the caller started
before. The runner prints one JSON line per verdict as it goes. It never hangs the caller: each
test has `timeout_s` (torch's own join loop, then SIGKILL), and the whole runner a deadline
after which its process group (runner, forkserver, ranks) is killed and the tests it had not
reported are `timeout`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
STARTUP_S = 120.0  # importing torch's test suite twice (runner and forkserver) on a loaded box
ERROR_LINES = 3


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
    failed rank; a traceback ends with its exception, after the last indented stack line.
    """
    parts = re.split(r"^(Process \d+) exited with error code \d+ and exception:\n", text,
                     flags=re.M)
    sections = list(zip(parts[1::2], parts[2::2], strict=True)) or [("", text)]
    out = []
    for rank, body in sections:
        lines = body.rstrip().splitlines()
        last_stack = max((i for i, line in enumerate(lines) if line.startswith("  ")), default=-1)
        tail = [line for line in lines[last_stack + 1:] if line.strip()][:ERROR_LINES]
        message = " | ".join(tail)[:400]
        if message and not any(message == m.split(": ", 1)[-1] for m in out):
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


def _run_here(names: list[str], ddps: list[str], timeout_s: float, spawned: bool) -> None:
    """In the runner process: run each test under each class, print a JSON line per verdict."""
    import multiprocessing.forkserver

    if not spawned:  # the server imports the suite while this process does, not after it
        multiprocessing.forkserver.set_forkserver_preload([f"{__package__}.cases"])
        multiprocessing.forkserver.ensure_running()
    from torch.testing._internal import common_distributed

    from .cases import case_class

    # torch's join loop times a test out at get_timeout(test_id) (300 s as shipped).
    common_distributed.get_timeout = lambda test_id: timeout_s
    for name in names:
        for ddp in ddps:
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
    """
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
           "RINGTRAIN_TORCH_SUITE_RETARGET": "1" if retarget else "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "tests.support.torch_ddp_suite.runner", "--ddp", ",".join(ddp),
           "--timeout", str(timeout_s), *(["--spawned"] if spawned else []), *names]
    deadline = time.monotonic() + STARTUP_S + len(names) * len(ddp) * (timeout_s + 15)
    log_file = open(log, "w") if log else tempfile.TemporaryFile("w+")  # noqa: SIM115
    verdicts: list[Verdict] = []
    with log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log_file,
                                text=True, start_new_session=True)
        try:
            for line in _lines_until(proc, deadline):
                if not line.startswith("{"):
                    continue
                verdicts.append(Verdict(**json.loads(line)))
                if on_verdict:
                    on_verdict(verdicts[-1])
        finally:
            _kill_group(proc.pid)  # the forkserver and any rank left over, or all on a deadline
            proc.wait()
        done = {(v.name, v.ddp) for v in verdicts}
        missing = [(n, d) for n in names for d in ddp if (n, d) not in done]
        if missing:
            log_file.flush()
            if log is None:
                log_file.seek(0)
                tail = log_file.read()[-2000:]
            else:
                tail = Path(log).read_text()[-2000:]
            why = ("runner killed at its deadline" if time.monotonic() > deadline
                   else f"runner exited {proc.returncode} before it: {tail.strip()[-300:]}")
            for n, d in missing:
                verdicts.append(Verdict(n, d, "timeout", 0.0, why))
    return verdicts


def _lines_until(proc: subprocess.Popen, deadline: float):
    """proc's stdout lines, until it closes or the deadline passes (checked by a timer thread)."""
    import threading

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), _kill_group, (proc.pid,))
    timer.daemon = True
    timer.start()
    try:
        yield from proc.stdout
    finally:
        timer.cancel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+")
    p.add_argument("--ddp", default="torch,ringtrain")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--spawned", action="store_true")
    args = p.parse_args(argv)
    _run_here(args.names, args.ddp.split(","), args.timeout, args.spawned)


if __name__ == "__main__":
    main()
