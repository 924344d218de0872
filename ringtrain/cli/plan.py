"""`ringtrain plan`: will the model fit? Bytes per rank under DDP and ZeRO stages 1, 2, 3.

    ringtrain plan --nproc-per-node 4 --n-layer 12 --n-embd 768 --vocab-size 50304 --block-size 1024
    ringtrain plan --nproc-per-node 8 --params 1.5B --memory-gb 16

Counts the GPT's parameters without allocating them (on the meta device), then prints, per
rank, the bytes of parameters, gradients and fp32 AdamW state each strategy holds (the ZeRO
paper's count, `ringtrain.zero.shard.expected_bytes`), stage 3's working set (the root unit and
two blocks gathered at once, see docs/zero.md) and, with --memory-gb, whether it fits.
Activations are not counted: they depend on the batch, and every strategy pays them.
"""

from __future__ import annotations

import argparse
import re

import torch

from ringtrain.errors import USAGE_EXIT_CODE
from ringtrain.models import GPT, GPTConfig
from ringtrain.strategies.zero import ZeroStrategy

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """An argparse type: a parameter count such as 17M, 1.5B or 124000000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; write e.g. 17M, 1.5B "
                                         "or 124000000")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def gpt_units(cfg: GPTConfig) -> tuple[int, int, int]:
    """(total parameters, the root unit's, the biggest block's), counted on the meta device."""
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return total, total - sum(blocks), max(blocks)


def plan_rows(numel: int, world_size: int, root: int | None = None,
              block: int | None = None) -> list[dict]:
    """Per strategy: bytes per rank of params, grads, optimizer, stage 3's working set, total."""
    rows = [{"strategy": "ddp", "params": 4.0 * numel, "grads": 4.0 * numel,
             "optimizer": 8.0 * numel, "working_set": 0.0}]
    for stage in (1, 2, 3):
        b = ZeroStrategy.bytes_per_rank(numel, world_size, stage)
        ws = 4.0 * (root + 2 * block) if stage == 3 and root is not None and block is not None else 0.0
        rows.append({"strategy": f"zero --zero-stage {stage}", **b, "working_set": ws})
    for r in rows:
        r["total"] = r["params"] + r["grads"] + r["optimizer"] + r["working_set"]
    return rows


def _gb(x: float) -> str:
    return f"{x / 2**30:9.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ringtrain plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks sharing the model")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--params", type=parse_count, help="parameter count (instead of the shape)")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--memory-gb", type=float, help="memory per rank: say which strategies fit")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) and USAGE_EXIT_CODE
    world = args.nproc_per_node * args.nnodes
    if world < 1:
        print(f"ringtrain plan: --nproc-per-node {args.nproc_per_node} x --nnodes {args.nnodes} "
              "ranks: there must be at least 1")
        return USAGE_EXIT_CODE
    if args.params is not None:
        numel, root, block = args.params, None, None
        shape = f"{numel:,} parameters (stage 3's working set needs the shape: --n-layer ...)"
    else:
        try:
            cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                            n_layer=args.n_layer, n_head=1, n_embd=args.n_embd)
        except ValueError as e:
            print(f"ringtrain plan: {e}")
            return USAGE_EXIT_CODE
        numel, root, block = gpt_units(cfg)
        shape = (f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} vocab_size={cfg.vocab_size} "
                 f"block_size={cfg.block_size}: {numel:,} parameters")
    print(f"{shape}; {world} ranks; fp32 AdamW; GiB per rank (activations not counted)")
    print(f"{'strategy':<22}{'params':>9} {'grads':>9} {'optim':>9} {'working':>9} {'total':>9}"
          + ("  fits" if args.memory_gb else ""))
    for r in plan_rows(numel, world, root, block):
        fits = ""
        if args.memory_gb:
            fits = "  yes" if r["total"] <= args.memory_gb * 2**30 else "  no"
        print(f"{r['strategy']:<22}{_gb(r['params'])} {_gb(r['grads'])} {_gb(r['optimizer'])} "
              f"{_gb(r['working_set'])} {_gb(r['total'])}{fits}")
    return 0
