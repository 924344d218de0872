"""Activation checkpointing: the memory one training step needs, with and without it.

    .venv/bin/python benchmarks/activation_checkpointing.py            # GPT 8 x 256, batch 32 x 256
    .venv/bin/python benchmarks/activation_checkpointing.py --quick    # a smaller model

Each variant runs in a fresh process (one thread): build the GPT, one warm-up step, then
`--steps` timed steps of forward + backward + AdamW. Reported per variant:
- `saved_mb`: the bytes autograd keeps for backward at the end of forward, counted from the
  tensors (a `saved_tensors_hooks` pair records every saved tensor's storage once; with
  checkpointing the blocks save nothing, and each block's input, which the checkpoint keeps
  for its recompute, is added: it is the only activation a checkpointed block holds);
- `peak_rss_delta_mb`: the peak resident memory of the process during the steps (ru_maxrss)
  minus its resident memory before them: what the allocator actually needed on top of the
  model and optimizer state;
- `step_ms`: the median step time (the recompute costs about one more forward of the blocks).
The last line printed is JSON, with the ratios of checkpointed to plain.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import time

import torch

from ringtrain.models import GPT, GPTConfig, loss_fn


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _saved_bytes(model: GPT, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saved in one forward (plus checkpointed inputs)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    kept = []
    hooks = []
    if model.config.activation_checkpointing:  # what each checkpoint keeps: its block's input
        hooks = [b.register_forward_pre_hook(lambda _m, args: kept.append(args[0]))
                 for b in model.blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for h in hooks:
        h.remove()
    for t in kept:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)  # weights are not activations


def _run(cfg: dict, checkpointing: bool, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["block"], n_layer=cfg["layers"],
                          n_head=cfg["heads"], n_embd=cfg["embd"],
                          activation_checkpointing=checkpointing))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["block"]), generator=g)
    y = torch.roll(x, 1, dims=1)

    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state allocated: what follows is the step's own working memory
    saved = _saved_bytes(model, x)
    before = _rss_mb()
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put({"saved_mb": round(saved / 2**20, 1), "peak_rss_delta_mb": round(peak - before, 1),
             "step_ms": round(statistics.median(times), 1),
             "params": sum(p.numel() for p in model.parameters())})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 layers x 128, batch 8")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.embd, args.batch, args.block = 4, 128, 8, 128
    cfg = {k: getattr(args, k)
           for k in ("layers", "embd", "heads", "block", "vocab", "batch", "steps")}
    ctx = mp.get_context("spawn")
    result: dict = {"config": cfg}
    for name, ac in (("plain", False), ("checkpointing", True)):
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(cfg, ac, q))
        p.start()
        result[name] = q.get(timeout=900)
        p.join(60)
        print(f"{name}: {result[name]}", flush=True)
    for k in ("saved_mb", "peak_rss_delta_mb", "step_ms"):
        result[f"{k}_ratio"] = round(result["checkpointing"][k] / max(result["plain"][k], 1e-9), 3)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
