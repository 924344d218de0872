#!/usr/bin/env bash
# The GPU session's checks in one run (issues 23 and 29): a lent GPU machine has its own python3
# with torch and no network, and minutes of device time, so everything goes in one command:
#
#     bash benchmarks/gpu_check.sh "$OUT" 560     # OUT: where the logs go; 560: seconds in all
#
# In order, each bounded by `timeout` so that a hang cannot eat the rest: the environment,
# ringtrain installed without dependencies, forked workers on CUDA (session 22), the CUDA
# tests, benchmarks/gpu_gpt.py (eager and compiled, trainer against nanoGPT's loop, MFU),
# benchmarks/snapshot_copy.py (a save's copies batched against one call per storage, session
# 17), benchmarks/snapshot_stall.py on CUDA (each step's parts with --phases; steps timed by
# CUDA events since session 18), the same at issue 29's snapshot every 50 steps, then the
# whole suite with the GPU visible, one xdist worker per file (`-v`, so a cut-off run still
# says which tests passed). Benchmarks first: they need a quiet machine. Each part's log is
# NAME.log in OUT/logs.tgz; GPU_CHECK_SKIP="a b" leaves parts
# out (a session that measured them already).
set -u
OUT=${1:?usage: gpu_check.sh OUT_DIR [SECONDS]}
BUDGET=${2:-560}
START=$(date +%s)
mkdir -p "$OUT/logs"
left() { echo $((BUDGET - ($(date +%s) - START))); }
SKIP=${GPU_CHECK_SKIP:-}  # parts left out, e.g. GPU_CHECK_SKIP="gpu_gpt suite"
part() {  # part NAME SECONDS CMD...: at most SECONDS, and never past the budget
    local name=$1 limit=$2; shift 2
    case " $SKIP " in *" $name "*) echo "== $name: left out (GPU_CHECK_SKIP)" | tee -a "$OUT/summary.log"; return;; esac
    local l; l=$(left)
    if [ "$l" -lt "$limit" ]; then limit=$l; fi
    if [ "$limit" -le 5 ]; then echo "== $name: skipped, budget spent" | tee -a "$OUT/summary.log"; return; fi
    echo "== $name (limit ${limit}s)" | tee -a "$OUT/summary.log"
    local t0; t0=$(date +%s)
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $(( $(date +%s) - t0 )) s; last lines:" | tee -a "$OUT/summary.log"
    tail -n 4 "$OUT/logs/$name.log" | tee -a "$OUT/summary.log"
}
{ nvidia-smi -L; python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'; nproc; } >"$OUT/summary.log" 2>&1
part install 120 python3 -m pip install -q --no-deps --no-build-isolation -e .
# Whether the warm process's imports initialise the CUDA driver (then it cannot fork, and every
# worker starts cold after waiting for it: ringtrain/launch/starts.py), a forked script's CUDA,
# and `ringtrain train` jobs with forked workers: one rank on NCCL, two sharing the GPU on gloo
# (sessions 21-22).
part zygote_cuda 60 python3 -c 'import ringtrain.launch.starts as s, importlib; [importlib.import_module(m) for m in s.PRELOAD + s.PRELOAD_RINGTRAIN]; import ringtrain.launch.zygote_server as z; print("fork refused:", z.fork_problem())'
# The launcher's own check of --device/--backend (launcher_gpu_count: torch.cuda.device_count)
# must leave the driver uninitialised, or its warm process cannot be its fork (session 23).
part launcher_fork 60 python3 -c 'from ringtrain.cli.train_args import check_args, parse_options; check_args(parse_options([])); import ringtrain.launch.zygote_server as z; print("launcher fork refused:", z.fork_problem())'
part forked_cuda 60 python3 benchmarks/forked_cuda.py cuda
part forked_cuda_job 150 bash -c 'python3 -m ringtrain train --nproc-per-node 1 --steps 20 \
    --run-dir /tmp/forked_nccl && python3 -m ringtrain train --nproc-per-node 2 --steps 20 \
    --backend gloo --device cuda --run-dir /tmp/forked_gloo'
part cuda_tests 130 python3 -m pytest -v -p no:cacheprovider -m cuda tests/test_cuda.py
part cuda_named 80 python3 -m pytest -v -p no:cacheprovider -k cuda tests/test_async_snapshots.py \
    tests/test_checkpoint.py tests/test_step_loop.py tests/test_device.py
part gpu_gpt 200 python3 benchmarks/gpu_gpt.py --compile --batch-size 16
part snapshot_copy 60 python3 benchmarks/snapshot_copy.py --device cuda
part snapshot_stall 200 python3 benchmarks/snapshot_stall.py --phases --every 100 --steps 405 \
    --rounds 2 --modes none,async
part snapshot_stall_50 120 python3 benchmarks/snapshot_stall.py --every 50 --steps 305 \
    --rounds 1 --modes none,async
part suite 600 python3 -m pytest -v -p no:cacheprovider -ra -n 12 --dist loadfile --timeout 300
echo "== done in $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.log"
# The device tool brings back at most 8 files: the logs come as one archive.
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
