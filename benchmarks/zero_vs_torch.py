"""ZeRO stages 1, 2, 3 (ringtrain.zero) against our DDP and torch's sharding, side by side.

    .venv/bin/python benchmarks/zero_vs_torch.py             # 16.8M and 75.6M params, 2 ranks
    .venv/bin/python benchmarks/zero_vs_torch.py --quick     # 3 rounds instead of 10
    .venv/bin/python benchmarks/zero_vs_torch.py --sizes 2x128x512 --rounds 2   # a smoke run

The model of benchmarks/ddp_vs_torch.py (8 residual Linear-GELU-Linear blocks, dim 512, hidden
2048: 16.8M parameters) and a larger one (16 blocks, dim 768, hidden 3072: 75.6M), batch 32
per rank, AdamW, 2 gloo ranks of 1 thread. Each block is one ZeRO unit (a model without blocks
would be one unit: `ringtrain.zero.default_units`). Every variant runs
once in its own pair of processes (its counted bytes and its own peak RSS), then all are built
in one pair of processes and timed `--steps` steps at a time, in an order that rotates from
round to round, so load from other processes hits all alike; the ratios to our DDP are medians
of per-round ratios.

Variants: ringtrain DDP; ZeRO-1/2/3 (`ZeroDataParallel`, one unit per block); torch's DDP +
`ZeroRedundancyOptimizer` (torch's stage 1); torch's `fully_shard` (FSDP2, stage 3) on each
block and the root, where it runs on gloo (its error is reported otherwise). Bytes are counted
from the tensors each rank holds after a step: parameters, gradients, optimizer state.

The last line printed is JSON: per model ("models": {"8x512x2048": ...}) and variant step_ms,
the bytes, peak_rss_mb, the ratios VARIANT_over_ddp (targets: zero2 <= 1.10, zero3 <= 1.5),
and the load average at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.models.mlp import residual_mlp
from ringtrain.testing import run_workers
from ringtrain.zero import ZeroDataParallel

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "torch_zero1", "torch_fsdp2")


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's part
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen or s.nbytes() == 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _opt_state(opt) -> list[torch.Tensor]:
    return [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def _make(variant: str, model: nn.Module):
    """(callable running forward+backward on (x, y), step(), counted bytes())"""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if variant == "ddp":
        net = DistributedDataParallel(model)
        opt = adamw(model.parameters())
        return net, opt.step, opt.zero_grad, lambda: {
            "param": _nbytes(model.parameters()),
            "grad": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": _nbytes(_opt_state(opt))}
    if variant.startswith("zero"):
        net = ZeroDataParallel(model, adamw, stage=int(variant[-1]))
        mem = net.memory
        return net, net.optimizer.step, net.optimizer.zero_grad, lambda: {
            k: mem()[f"{k}_bytes"] for k in ("param", "grad", "optimizer")}
    if variant == "torch_zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as TorchDDP
        net = TorchDDP(model)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
        )
        return net, opt.step, opt.zero_grad, lambda: {
            "param": _nbytes(model.parameters()),
            "grad": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": _nbytes(_opt_state(opt.optim))}
    from torch.distributed.fsdp import fully_shard
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = adamw(model.parameters())
    return model, opt.step, opt.zero_grad, lambda: {
        "param": _nbytes(model.parameters()),
        "grad": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": _nbytes(_opt_state(opt))}


def _step(net, step, zero_grad, x, y) -> None:
    nn.functional.mse_loss(net(x), y).backward()
    step()
    zero_grad()


def _alone(rank: int, world_size: int, variant: str, cfg: dict) -> dict:
    """One variant in a fresh pair of processes: its counted bytes and its peak RSS."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    y = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    try:
        model = residual_mlp(cfg["blocks"], cfg["dim"], cfg["hidden"])
        net, step, zero_grad, counted = _make(variant, model)
        for _ in range(2):
            nn.functional.mse_loss(net(x), y).backward()
            step()
            held = counted()  # after the step, before zero_grad: what a step keeps
            zero_grad()
    except Exception as e:  # noqa: BLE001 - a variant that does not run on gloo is reported
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**{f"{k}_bytes": v for k, v in held.items()}, "peak_rss_mb": round(rss, 1)}


def _paired(rank: int, world_size: int, variants: list[str], cfg: dict) -> dict:
    """Every variant built in the same pair of processes, timed in rotating order per round."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    y = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    built, errors = {}, {}
    for v in variants:
        try:
            built[v] = _make(v, residual_mlp(cfg["blocks"], cfg["dim"], cfg["hidden"]))[:3]
            for _ in range(cfg["warmup"]):
                _step(*built[v], x, y)
        except Exception as e:  # noqa: BLE001
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            built.pop(v, None)
    names = list(built)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(cfg["rounds"]):
        for v in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                _step(*built[v], x, y)
            dist.barrier()  # the slower rank's steps count
            times[v].append((time.perf_counter() - t0) / cfg["steps"] * 1e3)
    return {"times": times, "errors": errors}


def _parse_size(text: str) -> dict:
    blocks, dim, hidden = (int(v) for v in text.lower().split("x"))
    return {"blocks": blocks, "dim": dim, "hidden": hidden}


def _one_model(args: argparse.Namespace, size: dict, variants: list[str]) -> dict:
    """Every variant on one model: alone (bytes, peak RSS), then paired (step times)."""
    cfg = {**size, **{k: getattr(args, k) for k in ("batch", "steps", "warmup", "rounds")}}
    cfg["params"] = sum(
        p.numel() for p in residual_mlp(size["blocks"], size["dim"], size["hidden"]).parameters()
    )
    label = f"{size['blocks']}x{size['dim']}x{size['hidden']}"
    result: dict = {"config": cfg}
    for v in variants:
        out = run_workers(_alone, 2, args=(v, cfg), timeout_s=600)
        result[v] = {k: (max(o[k] for o in out) if k == "peak_rss_mb" else out[0][k])
                     for k in out[0]}
        print(f"{label} {v} alone: {result[v]}", flush=True)
    paired = run_workers(_paired, 2, args=(variants, cfg), timeout_s=1800)[0]
    for v, ts in paired["times"].items():
        result[v]["step_ms"] = round(statistics.median(ts), 1)
    for v, e in paired["errors"].items():
        result[v]["error"] = e
    ddp = paired["times"].get("ddp")
    for v, ts in paired["times"].items():
        if ddp and v != "ddp":
            # The median of per-round ratios: steadier than a ratio of medians on a busy host.
            result[f"{v}_over_ddp"] = round(
                statistics.median(t / d for t, d in zip(ts, ddp, strict=True)), 3
            )
        print(f"{label} {v}: step {result[v]['step_ms']} ms", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="8x512x2048,16x768x3072",
                    help="models as BLOCKSxDIMxHIDDEN, comma-separated "
                         "(default: the 16.8M model of ddp_vs_torch.py and a 75.6M one)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="rounds=3")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 3
    variants = args.variants.split(",")
    result: dict = {"models": {}}
    for text in args.sizes.split(","):
        size = _parse_size(text)
        result["models"][text] = _one_model(args, size, variants)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
