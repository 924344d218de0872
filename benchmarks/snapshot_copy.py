"""A snapshot's host copy with its storage copies batched (torch's foreach copy) against one
Python call per storage, alternated in one process.

    .venv/bin/python benchmarks/snapshot_copy.py                # CPU, ~1.5 min
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
`ByteViews.copy_all`, batched and not, alternated; `copies_ms` is the copy calls alone (the
byte tensors made once: `torch_internals.copy_tensors`, one foreach call against a loop of
`copy_`). Medians over --saves rounds (the first round, which allocates the buffers, not
counted). The last line is JSON; `*_ratio` is batched / per-tensor, of the medians of the wall
time; `*_cpu_ratio` of the thread's CPU time (`time.thread_time`), the figure that holds on a
loaded machine (on CUDA it leaves out the driver's own threads).
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
from ringtrain.torch_internals import copy_tensors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now() -> tuple[float, float]:
    """(wall, this thread's CPU) seconds: the CPU time is the figure a loaded machine keeps."""
    return time.perf_counter(), time.thread_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = _now()
    return t1[0] - t0[0], t1[1] - t0[1]


def _alternated(rounds: int, times: list, fn) -> dict[bool, list[tuple[float, float]]]:
    """`fn(batched, times)` batched and not, in an order that alternates, `rounds` + 1 times;
    what `fn` appended to `times` from the second round on, by mode."""
    by: dict[bool, list] = {True: [], False: []}
    for i in range(rounds + 1):
        for batched in ((True, False) if i % 2 else (False, True)):
            times.clear()
            fn(batched, times)
            if i:
                by[batched] += times
    return by


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
    calls = {}

    def save(batched: bool, times: list) -> None:  # the in-step part, then the writer's
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        _sync(device)
        before = hosts[batched].copy_calls
        t0 = _now()
        staged = hosts[batched].copy(state, later=later)
        times.append(("step", _since(t0)))
        t0 = _now()
        staged.finish()
        times.append(("finish", _since(t0)))
        _sync(device)
        calls[batched] = hosts[batched].copy_calls - before

    saves = _alternated(args.saves, [], save)
    parts = {part: {b: [t for p, t in saves[b] if p == part] for b in saves}
             for part in ("step", "finish")}
    # The per-call cost alone: as many storages as the state defers, 64 bytes each, on the
    # device (the step's staging copies: device to device).
    n = len({t.untyped_storage().data_ptr() for t in later})
    pairs = [(torch.empty(64, dtype=torch.uint8, device=device).untyped_storage(),
              torch.full((64,), i % 251, dtype=torch.uint8, device=device).untyped_storage())
             for i in range(n)]
    views = {True: ByteViews(batched=True), False: ByteViews(batched=False)}

    def calls_through_views(batched: bool, times: list) -> None:
        views[batched].start()
        _sync(device)
        t0 = _now()
        views[batched].copy_all(pairs, device.type != "cpu")
        times.append(_since(t0))
        _sync(device)

    parts["calls"] = _alternated(args.saves, [], calls_through_views)
    # The copy calls alone, on tensors made once: what the foreach call replaces, nothing else.
    dsts = [torch.empty(0, dtype=torch.uint8, device=device).set_(h) for h, _ in pairs]
    srcs = [torch.empty(0, dtype=torch.uint8, device=device).set_(s) for _, s in pairs]

    def copies(batched: bool, times: list) -> None:
        _sync(device)
        t0 = _now()
        copy_tensors(dsts, srcs, device.type != "cpu", batched)
        times.append(_since(t0))
        _sync(device)

    parts["copies"] = _alternated(args.saves, [], copies)
    out = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else device),
           "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
           "deferred_storages": n, "saves": args.saves,
           "copy_calls_per_save": {"batched": calls[True], "per_tensor": calls[False]}}
    for part, by in parts.items():
        # Medians (ms) of the wall time and of the thread's CPU time, batched and per tensor.
        ms = {f"{mode}{kind}": round(1e3 * statistics.median(t[k] for t in by[batched]), 3)
              for mode, batched in (("batched", True), ("per_tensor", False))
              for k, kind in ((0, ""), (1, "_cpu"))}
        out[f"{part}_ms"] = ms
        out[f"{part}_ratio"] = round(ms["batched"] / ms["per_tensor"], 3)
        out[f"{part}_cpu_ratio"] = round(ms["batched_cpu"] / ms["per_tensor_cpu"], 3)
        print(f"{part:7s} wall: batched {ms['batched']:9.3f} ms, per tensor "
              f"{ms['per_tensor']:9.3f} ms ({out[part + '_ratio']}x); CPU: "
              f"{ms['batched_cpu']:9.3f} against {ms['per_tensor_cpu']:9.3f} ms "
              f"({out[part + '_cpu_ratio']}x)")
    out["loadavg"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
