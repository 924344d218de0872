"""Tensor and sequence parallelism: activation memory per rank and bytes per step, by layout.

    .venv/bin/python benchmarks/tensor_parallel.py            # GPT 4 x 256, batch 4 x 256
    .venv/bin/python benchmarks/tensor_parallel.py --quick    # a smaller model

Layouts: tp 1 (the plain GPT in one process), tp 2 and tp 4 (gloo ranks on this machine, one
thread each), each without sequence parallelism, with it, and with it and `recompute_gather`
(the column layers save their input's shard and all-gather it again in backward). Reported
per layout:
- `saved_mb`: bytes autograd keeps for backward at the end of one forward + loss, on rank 0
  (`ringtrain.pipeline.memory.ActivationMeter`: each saved storage once, parameters not at
  all). The logits are vocab-sharded under tp, so the loss's saved softmax is 1/t too;
- `counted` against `formula`: the bytes of each collective in one step, counted by wrapping
  torch.distributed's calls, next to `ringtrain.tensor_parallel.expected_bytes`;
- `step_ms`: the median of `--steps` steps (forward, loss, backward, AdamW) on rank 0; on a
  2-core machine more ranks than cores only shows the overhead, not a speed-up.
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.pipeline.memory import ActivationMeter
from ringtrain.tensor_parallel import expected_bytes, gpt_plan, parallelize
from ringtrain.tensor_parallel import vocab_parallel_cross_entropy as vp_loss
from ringtrain.testing import run_workers

COLLECTIVES = {"all_reduce": ("all_reduce", 0), "all_gather_into_tensor": ("all_gather", 0),
               "all_gather_single": ("all_gather", 0),
               "reduce_scatter_tensor": ("reduce_scatter", 1),
               "reduce_scatter_single": ("reduce_scatter", 1)}


def _count_collectives(counted: dict) -> dict:
    real = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    for name, fn in real.items():
        key, which = COLLECTIVES[name]

        def wrapper(*args, _fn=fn, _key=key, _which=which, **kwargs):
            counted[_key] += args[_which].numel() * args[_which].element_size()
            return _fn(*args, **kwargs)
        setattr(dist, name, wrapper)
    return real


def _measure(rank: int, world_size: int, config: GPTConfig, batch: int, sp: bool, rg: bool,
             steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(config)
    group = dist.group.WORLD if world_size > 1 else None
    if group is not None:
        plan = gpt_plan(sequence_parallel=sp, recompute_gather=rg)
        model = parallelize(copy.deepcopy(model), plan, group)

    def loss_of(idx, targets):
        logits = model(idx)
        return loss_fn(logits, targets) if group is None else vp_loss(logits, targets, group)

    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    meter = ActivationMeter(model)
    with meter.saving(0):
        loss = loss_of(idx, targets)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counted = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    times = []
    for step in range(steps + 1):
        real = _count_collectives(counted) if step == 0 and group is not None else {}
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_of(idx, targets).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        for name, fn in real.items():
            setattr(dist, name, fn)
    formula = expected_bytes(n_layer=config.n_layer, n_embd=config.n_embd, batch=batch,
                             seq=config.block_size, sequence_parallel=sp, bias=config.bias,
                             recompute_gather=rg)
    return {"tp": world_size, "sequence_parallel": sp, "recompute_gather": rg,
            "saved_mb": round(meter.peak / 2**20, 2),
            "counted": counted if group is not None else None,
            "formula": formula if group is not None else None,
            "step_ms": round(1e3 * statistics.median(times[1:]), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT 2 x 64, batch 2 x 64")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        config, batch = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                                  n_embd=64), 2
    else:
        config, batch = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8,
                                  n_embd=256), 4
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = [_measure(0, 1, config, batch, False, False, args.steps)]
    for tp in (2, 4):
        for sp, rg in ((False, False), (True, False), (True, True)):
            rows.append(run_workers(_measure, tp, args=(config, batch, sp, rg, args.steps),
                                    timeout_s=600)[0])
    for r in rows:
        ok = "" if r["counted"] is None else f" counted==formula: {r['counted'] == r['formula']}"
        print(f"tp={r['tp']} sp={r['sequence_parallel']!s:5} "
              f"recompute_gather={r['recompute_gather']!s:5} saved {r['saved_mb']:7.2f} MiB "
              f"step {r['step_ms']:8.1f} ms{ok}")
    print(json.dumps({"config": {"n_layer": config.n_layer, "n_embd": config.n_embd,
                                 "n_head": config.n_head, "vocab_size": config.vocab_size,
                                 "batch": batch, "seq": config.block_size},
                      "layouts": rows, "loadavg_before": load, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
