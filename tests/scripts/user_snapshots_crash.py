"""examples/ddp_snapshots.py whose rank 1 dies (os._exit, no cleanup) in its CRASH_AT_STEP-th
optimizer step of the job's first attempt; `ringtrain run --max-restarts 1` then restarts both
ranks, which resume from the newest committed snapshot.

    CRASH_AT_STEP=25 ringtrain run --nproc-per-node 2 --max-restarts 1 \
        tests/scripts/user_snapshots_crash.py --run-dir RUN_DIR
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ddp_snapshots  # noqa: E402

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1":
    crash_at, calls, step = int(os.environ["CRASH_AT_STEP"]), [0], torch.optim.SGD.step

    def dying_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == crash_at:
            os._exit(17)  # as a killed worker: no exception, no exit handler
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = dying_step
ddp_snapshots.main()
