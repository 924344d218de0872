"""A snapshot's host copy with its storage copies batched (torch's foreach copy) against one
Python call per storage, alternated in one process.

    .venv/bin/python benchmarks/snapshot_copy.py                # CPU, ~1 min
    python3 benchmarks/snapshot_copy.py --device cuda           # in benchmarks/gpu_check.sh

The state: snapshot_stall.py's GPT (14 layers, 768 wide, 99 M parameters) and its AdamW state
after one step, `later` = the parameters and moments (what ddp's `updated_state()` declares).
Each round saves it through `HostCopy(batched=True)` and `HostCopy(batched=False)`, in an order
that alternates, and times the two halves of a save:
- `step_ms`: `HostCopy.copy`, the part of a save in the training step. On CUDA with device
  staging it queues a device copy of each of the ~500 deferred storages (the figure the issue
  wants down); on the CPU the deferred storages are only viewed there, and the step copies only
  what is not deferred (AdamW's ~170 step counts);
- `finish_ms`: `StagedCopy.finish`, the writer's thread: the deferred storages to the host
  (CPU: ~1.2 GB of memcpy, which hides the calls; CUDA: the copies off the staging buffers).
Then `calls_ms` isolates the per-call cost: the same number of storages as the state defers,
64 bytes each (so that the bytes cost nothing, as an asynchronous device copy costs the host
nothing), copied on the device into kept buffers (as the step's staging copies) through
`ByteViews.copy_all`, batched and not, alternated. Medians over --saves rounds (the first
save of each, which allocates the buffers, not counted). The last line is JSON; `*_ratio` is
batched / per-tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ringtrain.checkpoint.host_copy import HostCopy
from ringtrain.checkpoint.kept_views import ByteViews
from ringtrain.models import GPT, GPTConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--saves", type=int, default=21, help="timed saves per mode (plus one)")
    p.add_argument("--n-layer", type=int, default=14)
    args = p.parse_args()
    torch.set_num_threads(1)  # training's one thread, as snapshot_stall.py on the CPU
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=args.n_layer, n_head=12,
                          n_embd=768, dropout=0.0)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 65, (1, 64), device=device)).float().sum().backward()
    opt.step()
    later = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                        if torch.is_tensor(v) and v.dim()]
    hosts = {True: HostCopy(batched=True), False: HostCopy(batched=False)}
    times: dict[str, dict[bool, list[float]]] = {"step": {True: [], False: []},
                                                 "finish": {True: [], False: []}}
    calls = {}
    for i in range(args.saves + 1):
        for batched in ((True, False) if i % 2 else (False, True)):
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            _sync(device)
            before = hosts[batched].copy_calls
            t0 = time.perf_counter()
            staged = hosts[batched].copy(state, later=later)
            t1 = time.perf_counter()
            staged.finish()
            t2 = time.perf_counter()
            _sync(device)
            calls[batched] = hosts[batched].copy_calls - before
            if i:
                times["step"][batched].append(t1 - t0)
                times["finish"][batched].append(t2 - t1)
            del staged, state
    # The per-call cost alone: as many storages as the state defers, 64 bytes each, on the
    # device (the step's staging copies: device to device).
    n = len({t.untyped_storage().data_ptr() for t in later})
    pairs = [(torch.empty(64, dtype=torch.uint8, device=device).untyped_storage(),
              torch.full((64,), i % 251, dtype=torch.uint8, device=device).untyped_storage())
             for i in range(n)]
    views = {True: ByteViews(batched=True), False: ByteViews(batched=False)}
    times["calls"] = {True: [], False: []}
    for i in range(args.saves + 1):
        for batched in ((True, False) if i % 2 else (False, True)):
            views[batched].start()
            _sync(device)
            t0 = time.perf_counter()
            views[batched].copy_all(pairs, device.type != "cpu")
            t1 = time.perf_counter()
            _sync(device)
            if i:
                times["calls"][batched].append(t1 - t0)
    out = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else device),
           "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
           "deferred_storages": n, "saves": args.saves,
           "copy_calls_per_save": {"batched": calls[True], "per_tensor": calls[False]}}
    for part, by in times.items():
        b, t = _median_ms(by[True]), _median_ms(by[False])
        out[f"{part}_ms"] = {"batched": b, "per_tensor": t}
        out[f"{part}_ratio"] = round(b / t, 3) if t else None
        print(f"{part:7s} batched {b:9.3f} ms   per tensor {t:9.3f} ms   "
              f"ratio {out[part + '_ratio']}")
    out["loadavg"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
