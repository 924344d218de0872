"""Fail chosen ranks at chosen attempts, so that a test can count a job's restarts across nodes.

    ringtrain run --nnodes 2 ... --max-restarts 2 tests/scripts/restart_count.py OUT_DIR 0:1 1:0

Each worker writes OUT_DIR/attempt{n}-rank{r} (n: TORCHELASTIC_RESTART_COUNT, the restart count
the program sees) and checks with an all-reduce that every rank sees the same n. Then a rank
named for this attempt (ATTEMPT:RANK) exits with 1, and the others sleep out of any collective
until their agent restarts them: their own workers did not fail, which is the case torch's
per-node count got wrong. In an attempt with no failure every rank finishes.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import ringtrain
from ringtrain.launch.parent import die_with_parent

WAIT_S = 60.0  # for a survivor: longer than any restart takes, shorter than the test's bound


def main() -> None:
    die_with_parent()
    out, plan = sys.argv[1], [tuple(int(x) for x in p.split(":")) for p in sys.argv[2:]]
    rt = ringtrain.init_distributed()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    open(os.path.join(out, f"attempt{attempt}-rank{rt.rank}"), "w").close()
    seen = torch.tensor([attempt, -attempt])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # (max, -min) of the ranks' counts
    if seen[0] != -seen[1]:
        sys.exit(f"rank {rt.rank}: the ranks disagree on the restart count: it is {attempt} here, "
                 f"between {-int(seen[1])} and {int(seen[0])} across the job")
    failing = [r for a, r in plan if a == attempt]
    if rt.rank in failing:
        print(f"rank {rt.rank}: failing in attempt {attempt}", file=sys.stderr, flush=True)
        os._exit(1)
    if failing:
        time.sleep(WAIT_S)  # the agent stops this worker when the job restarts
        sys.exit(f"rank {rt.rank}: not restarted within {WAIT_S:g} s of rank {failing}'s failure")
    ringtrain.destroy_distributed()


if __name__ == "__main__":
    main()
