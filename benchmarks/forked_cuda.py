"""Whether a worker forked from the job's warm process can use CUDA (gpu_check.sh, session 22).

    python3 benchmarks/forked_cuda.py          # cuda; `cpu` to try it on a box without a GPU

Forks a small script through `ringtrain.launch.starts.Starts` as a live job starts a worker
(a fork, or cold where the warm process refuses: it says why) and prints whether it forked,
what the child computed on the device, and how long the start took. A forked child's CUDA works
only if the warm process never initialised the CUDA driver (`zygote_server.fork_problem`; session
22 found `import torch` loads it, uninitialised, and the first check refused every fork).
"""

import os
import subprocess
import sys
import tempfile
import time

from ringtrain.launch.starts import Starts, forked

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if device not in ("cuda", "cpu") or len(sys.argv) > 2:
    sys.exit(f"usage: forked_cuda.py [cuda|cpu] (got {sys.argv[1:]}): the device the forked "
             "child computes on")
script = os.path.join(tempfile.mkdtemp(), "child.py")
with open(script, "w") as f:
    f.write("import os, torch\n"
            f"x = torch.ones(1000, device={device!r})\n"
            "name = torch.cuda.get_device_name(0) if x.is_cuda else 'cpu'\n"
            "print('child', os.getpid(), 'sum', x.sum().item(), name, flush=True)\n")
starts = Starts(fork=True, live=True)
t0 = time.monotonic()
proc = starts.start(lambda args, env: subprocess.Popen(args, env=env),
                    (sys.executable, "-u", script), dict(os.environ), None, None)
print(f"forked: {forked(proc)} (why not: {starts.off}), start {time.monotonic() - t0:.2f} s",
      flush=True)
code = proc.wait(120)
print(f"exit: {code}", flush=True)
starts.close()
sys.exit(code)
