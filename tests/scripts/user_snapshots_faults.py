"""examples/ddp_snapshots.py with faults the environment chooses (tests/test_user_snapshots.py):

- CRASH_AT_STEP=N: rank 1 dies (os._exit, no cleanup) in its N-th optimizer step, in the job's
  first attempt only; `ringtrain run --max-restarts 1` then restarts both ranks;
- STEP_SLEEP=S: every optimizer step takes S seconds longer (a job slow enough to be signalled
  mid-run), and rank 0 creates the file READY_FILE after its 5th step.

    CRASH_AT_STEP=25 ringtrain run --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/user_snapshots_faults.py --run-dir RUN_DIR
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ddp_snapshots  # noqa: E402

first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
rank = int(os.environ.get("RANK", "0"))
crash_at = int(os.environ.get("CRASH_AT_STEP", "0")) if first_attempt and rank == 1 else 0
pause = float(os.environ.get("STEP_SLEEP", "0"))
calls, step = [0], torch.optim.SGD.step


def faulty_step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == crash_at:
        os._exit(17)  # as a killed worker: no exception, no exit handler
    time.sleep(pause)
    if pause and rank == 0 and calls[0] == 5:
        Path(os.environ["READY_FILE"]).touch()
    return step(self, *args, **kwargs)


torch.optim.SGD.step = faulty_step
ddp_snapshots.main()
