"""torch's own DDP tests, run against ringtrain's DistributedDataParallel (issue 25).

    python -m tests.support.torch_ddp_suite --all      # from the repository root: table + counts

The DDP tests of the installed torch's `distributed_test.py` run the way torch's
`test/distributed/test_distributed_spawn.py` runs them (gloo, world size 2, `TestDistBackend`),
once with torch's `DistributedDataParallel` and once with ringtrain's swapped in, in every rank,
for the names the tests reach it by. GPU-only tests are pointed at the CPU by the same patches for
both classes, so a test counts only where torch's own DDP passes. docs/ddp_compat.md has the
counts and why each remaining test does not pass with ringtrain.

Read in this order:
- `names.py`: which tests are DDP tests (parsed, not imported).
- `retarget.py`: the patches: GPU tests run on the CPU, the DDP class swap.
- `cases.py`: torch's test class with the class chosen; ranks forked per test (or spawned).
- `runner.py`: `run_tests(names, ddp=...)` -> a `Verdict` per test and class, in a subprocess
  with a timeout per test and a deadline for all (never hangs).
- `expected.py`: the documented exceptions (tests of torch's private internals, deliberate
  differences), each with its reason.
- `__main__.py`: the command (table, categories, a JSON line with the counts).

Needs `expecttest` (torch's test utilities import it; in the `dev` extra). Tests:
tests/test_torch_ddp_suite.py. Import from the modules (`runner.run_tests`, `names.ddp_test_names`):
this file imports nothing, so `python -m ...runner` does not import the runner twice.
"""

