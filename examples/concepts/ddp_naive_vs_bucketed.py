"""What DistributedDataParallel does: average every gradient across ranks. Naive, then bucketed.

    .venv/bin/python examples/concepts/ddp_naive_vs_bucketed.py      # 2 ranks, ~10 s

Both wrappers start every replica from rank 0's weights and leave each rank's gradients equal
to the average over ranks, each rank having run backward on its own half of the batch. The naive
reference (`ringtrain/ddp/naive.py`) waits for backward to finish, then all-reduces the
gradients one parameter at a time; `ringtrain.DistributedDataParallel` (`ringtrain/ddp/
distributed.py`, `reducer.py`) packs them into buckets and starts each bucket's all-reduce from
a hook as soon as its gradients are ready, while backward goes on. This counts the all-reduce
calls of one step and checks the two give the same gradients.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ringtrain.data.addition import AdditionDataset
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.naive import NaiveDistributedDataParallel
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.testing import run_workers


def _worker(rank: int, world_size: int) -> dict:
    data = AdditionDataset("train")
    x, y = data.x[rank * 64:(rank + 1) * 64], data.y[rank * 64:(rank + 1) * 64]  # this rank's half
    calls = [0]
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    out, grads = {}, {}
    for name in ("naive", "ddp"):
        torch.manual_seed(rank)  # different weights per rank: the wrapper must broadcast rank 0's
        model = GPT(GPTConfig(vocab_size=10, block_size=6))  # `make demo`'s GPT
        net = (NaiveDistributedDataParallel if name == "naive" else DistributedDataParallel)(model)
        times = []
        for _ in range(10):
            model.zero_grad(set_to_none=True)
            calls[0] = 0
            dist.all_reduce = counted
            t0 = time.perf_counter()
            try:
                loss_fn(net(x), y).backward()
                if name == "naive":
                    net.sync_gradients()  # the whole algorithm, after backward
            finally:
                dist.all_reduce = all_reduce
            times.append(time.perf_counter() - t0)
        grads[name] = [p.grad.clone() for p in model.parameters()]
        out[name] = {"all_reduce_calls": calls[0], "ms": statistics.median(times) * 1e3,
                     "tensors": len(grads[name])}
    out["max_grad_diff"] = max(float((a - b).abs().max())
                               for a, b in zip(*grads.values(), strict=True))
    return out


def main() -> None:
    r0 = run_workers(_worker, 2, timeout_s=120)[0]
    for name in ("naive", "ddp"):
        r = r0[name]
        print(f"{name:<6} {r['tensors']} gradient tensors -> {r['all_reduce_calls']} all_reduce "
              f"call(s) per step; forward + backward + sync {r['ms']:.2f} ms (median of 10)")
    print(f"largest difference between their averaged gradients: {r0['max_grad_diff']:.2e}")


if __name__ == "__main__":
    main()
