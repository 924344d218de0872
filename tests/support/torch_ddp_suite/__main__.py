"""Run torch's DDP tests with torch's DDP and with ringtrain's; print a table and the counts.

    python -m tests.support.torch_ddp_suite --all                   # 104 tests x 2 classes
    python -m tests.support.torch_ddp_suite test_ddp_logging_data_cpu --ddp ringtrain
    python -m tests.support.torch_ddp_suite --all --spawned --ddp torch   # torch's start method
    python -m tests.support.torch_ddp_suite --all --no-retarget     # as shipped: GPU tests skip
    python -m tests.support.torch_ddp_suite --list

From the repository root, with the dev extra installed (expecttest: torch's test utilities
import it). Prints a markdown table (each test, its verdict under each class, seconds, the first
lines of ringtrain's error or the skip reason), the tests by category, and last a JSON line with
the counts: run, pass with torch, pass with ringtrain among those, names per category.
--results FILE writes the same output there too (/work/briefs/harness-results.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from .expected import EXPECTED_FAILURES, NOT_RUN
from .names import ddp_test_names
from .runner import Verdict, run_tests

CATEGORIES = {
    "pass_both": "pass with torch's DDP and with ringtrain's",
    "ringtrain_fails": "pass with torch's DDP, not with ringtrain's, NOT in the documented list",
    "ringtrain_fails_documented": "pass with torch's DDP, not with ringtrain's, documented "
                                  "(tests/support/torch_ddp_suite/expected.py)",
    "ringtrain_only": "fail with torch's DDP under these patches, pass with ringtrain's",
    "torch_fails": "fail with torch's DDP under these patches (not counted)",
    "skip": "skip with torch's DDP (not counted)",
}


def categorize(verdicts: list[Verdict]) -> dict[str, list[str]]:
    """Each test's category from its torch and ringtrain verdicts (both must be present)."""
    by = {(v.name, v.ddp): v.verdict for v in verdicts}
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for name in dict.fromkeys(v.name for v in verdicts):
        t, r = by.get((name, "torch")), by.get((name, "ringtrain"))
        if t == "skip":
            cat = "skip"
        elif t == "pass":
            cat = ("pass_both" if r == "pass" else "ringtrain_fails_documented"
                   if name in EXPECTED_FAILURES else "ringtrain_fails")
        else:
            cat = "ringtrain_only" if r == "pass" else "torch_fails"
        out[cat].append(name)
    return out


def counts(verdicts: list[Verdict], retarget: bool, not_run: list[str] = ()) -> dict:
    import torch

    cats = categorize(verdicts)
    by = Counter((v.ddp, v.verdict) for v in verdicts)
    torch_pass = len(cats["pass_both"]) + len(cats["ringtrain_fails"]) + len(
        cats["ringtrain_fails_documented"])
    return {"torch": torch.__version__, "retarget": retarget,
            "run": len({v.name for v in verdicts}), "pass_torch": torch_pass,
            "pass_ringtrain": len(cats["pass_both"]),
            "pass_ringtrain_total": by["ringtrain", "pass"],
            "skip_torch": by["torch", "skip"],
            "categories": cats, "not_run": list(not_run),
            # documented as failing, yet passing: take them out of expected.py and the docs
            "documented_passing": [n for n in cats["pass_both"] if n in EXPECTED_FAILURES]}


def table(verdicts: list[Verdict]) -> list[str]:
    by = {(v.name, v.ddp): v for v in verdicts}
    ddps = list(dict.fromkeys(v.ddp for v in verdicts))
    lines = ["| test | " + " | ".join(ddps) + " | seconds | why (ringtrain's error, or torch's "
             "error or skip reason) |", "|---" * (len(ddps) + 3) + "|"]
    for name in dict.fromkeys(v.name for v in verdicts):
        row = [by[name, d] for d in ddps if (name, d) in by]
        why = next((v.error for v in reversed(row) if v.error and v.verdict != "pass"), "")
        lines.append(f"| {name} | " + " | ".join(v.verdict for v in row) + " | "
                     + "/".join(f"{v.seconds:g}" for v in row) + f" | {why.replace('|', '/')} |")
    return lines


def report(verdicts: list[Verdict], retarget: bool, not_run: dict[str, str] | None = None
           ) -> list[str]:
    lines = table(verdicts)
    not_run = not_run or {}
    if {v.ddp for v in verdicts} >= {"torch", "ringtrain"}:
        c = counts(verdicts, retarget, list(not_run))
        lines.append("")
        for cat, names in c["categories"].items():
            lines.append(f"{cat} ({len(names)}): {CATEGORIES[cat]}")
            lines += [f"  {n}" + (f": {EXPECTED_FAILURES[n]}" if n in EXPECTED_FAILURES
                                  and cat == "ringtrain_fails_documented" else "")
                      for n in names]
        if c["documented_passing"]:
            lines.append(f"documented_passing ({len(c['documented_passing'])}): in "
                         "expected.EXPECTED_FAILURES yet passing: take them out (and the docs')")
            lines += [f"  {n}" for n in c["documented_passing"]]
        if not_run:
            lines.append(f"not_run ({len(not_run)}): left out (--include-slow runs them)")
            lines += [f"  {n}: {why}" for n, why in not_run.items()]
        lines.append(json.dumps(c))
    else:
        lines.append(json.dumps({"run": len(verdicts), **Counter(v.verdict for v in verdicts)}))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="test names (default with --all: every DDP test)")
    p.add_argument("--all", action="store_true", help="every DDP test of distributed_test.py "
                   "but those of expected.NOT_RUN (too slow here)")
    p.add_argument("--include-slow", action="store_true", help="--all runs NOT_RUN's too")
    p.add_argument("--list", action="store_true", help="print the DDP tests' names and exit")
    p.add_argument("--ddp", default="torch,ringtrain", help="torch, ringtrain, or both")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per test and class")
    p.add_argument("--spawned", action="store_true",
                   help="spawn the ranks per test (torch's way, slow), not fork them")
    p.add_argument("--no-retarget", action="store_true", help="run the tests as shipped")
    p.add_argument("--results", type=Path, help="also write the output to this file")
    p.add_argument("--log", type=Path, help="the ranks' logs (stderr) go here")
    args = p.parse_args(argv)
    names = args.names
    if args.all:
        names = [n for n in ddp_test_names() if args.include_slow or n not in NOT_RUN]
    if args.list:
        print("\n".join(ddp_test_names()))
        return 0
    if not names:
        p.error("name tests or pass --all")

    def progress(v: Verdict) -> None:
        print(f"{v.name} [{v.ddp}]: {v.verdict} ({v.seconds:g} s) {v.error[:150]}",
              file=sys.stderr, flush=True)

    retarget = not args.no_retarget
    verdicts = run_tests(names, tuple(args.ddp.split(",")), timeout_s=args.timeout,
                         spawned=args.spawned, retarget=retarget, log=args.log,
                         on_verdict=progress)
    left_out = {} if args.include_slow or not args.all else NOT_RUN
    out = report(verdicts, retarget, left_out)
    print("\n".join(out))
    if args.results:
        header = [f"# torch's DDP tests with ringtrain's DDP: `python -m tests.support."
                  f"torch_ddp_suite {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
        args.results.write_text("\n".join(header + out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
