"""`ringtrain plan`: will the model fit, and how to lay it out? DDP, ZeRO 1/2/3, pipeline, tp.

    ringtrain plan --nproc-per-node 4 --n-layer 12 --n-embd 768 --vocab-size 50304 --block-size 1024
    ringtrain plan --nproc-per-node 8 --params 1.5B --memory-gb 16
    ringtrain plan --nproc-per-node 8 --n-layer 24 --n-embd 2048 --n-head 16 --memory-gb 40

Counts the GPT's parameters without allocating them (on the meta device), then prints per rank,
for each strategy: the bytes of parameters, gradients and fp32 AdamW state it holds (the ZeRO
paper's count, `ringtrain.zero.shard.expected_bytes`; a pipeline stage holds 16 bytes per
parameter of its layers, split as `--strategy pipeline` splits them), stage 3's working set
(the root unit and two blocks gathered at once, see docs/zero.md; a model given as a
parameter count is one unit), the bytes each rank sends per step, and a step time by a simple
model: compute 6 x parameters x tokens / --tflops (a pipeline: its heaviest stage, times the
bubble (m + pp - 1) / m of m = 4 x pp micro-batches) plus the bytes sent over --link-gbit (no
overlap assumed). With --memory-gb it says which fit; it names the fastest (of those that fit).
Activations are not counted in that first table: they depend on the batch, and every strategy
pays them (a pipeline stage pays them for its layers only: `--activation-checkpointing` cuts
them for all).

A model given by its shape gets a second table: every layout dp x pp x tp of the ranks (tp
inside one node of --nproc-per-node ranks, dividing --n-head and the vocabulary; ZeRO 1-3 on
the dp axis), per rank its parameters, gradients, AdamW state and activations (with and without
sequence parallelism) and the bytes it sends per step on each axis, from the formulas of
`ringtrain.strategies.layouts` (which `ringtrain explain` uses for --strategy tp), and the layout
it recommends, with the rule (`layouts.RULE`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch

from ringtrain.config.suggest import suggest_flags
from ringtrain.errors import USAGE_EXIT_CODE
from ringtrain.models import GPT, GPTConfig
from ringtrain.strategies import layouts
from ringtrain.strategies.pipeline import partition  # the pipeline strategy's own split
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


def gpt_stages(cfg: GPTConfig, pp: int) -> list[int] | None:
    """Parameters of each of `pp` pipeline stages, split as `--strategy pipeline --pp` splits
    the GPT (embedding, blocks, head balanced by parameters); None: fewer layers than stages."""
    if not 1 < pp <= cfg.n_layer + 2:
        return None
    with torch.device("meta"):
        stages = partition(GPT(cfg).to_sequential(), pp)
    return [sum(p.numel() for p in s.parameters()) for s in stages]


def model_shape(cfg: GPTConfig, world_size: int) -> layouts.ModelShape:
    """The GPT's sizes and, for every pipeline degree that divides `world_size`, its stages'
    (parameters, those tp keeps whole, layers), split as `--strategy pipeline` splits it."""
    with torch.device("meta"):
        model = GPT(cfg)
        stages: dict[int, list[tuple[int, int, int]]] = {}
        for pp in range(2, min(world_size, cfg.n_layer + 2) + 1):
            if world_size % pp == 0:
                parts = partition(model.to_sequential(), pp)
                stages[pp] = [(sum(p.numel() for p in s.parameters()), layouts.whole_numel(s),
                               sum(isinstance(m, type(model.blocks[0])) for m in s))
                              for s in parts]
    return layouts.ModelShape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size,
                              cfg.block_size, sum(p.numel() for p in model.parameters()),
                              layouts.whole_numel(model), stages)


def print_layouts(shape: layouts.ModelShape, world_size: int, host: int, batch: int,
                  memory_gb: float | None) -> layouts.LayoutFigures | None:
    """The layout table and the recommendation; returns the recommended row."""
    rows = [layouts.layout_figures(lay, shape, batch=batch)
            for lay in layouts.layouts(world_size, shape, host=host)]
    limit = None if memory_gb is None else memory_gb * 2**30
    best, rule = layouts.recommend(rows, limit)
    print(f"\nlayouts of {world_size} ranks (dp x pp x tp, ZeRO on dp; tp within a node of "
          f"{host}), GiB per rank with activations of {batch} samples per replica (act: tp "
          "alone, act+SP: with sequence parallelism, counted in total; rg: also with "
          "--recompute-gather), MB sent per rank per step on each axis:")
    print(f"{'dp x pp x tp':<13}{'zero':>5}{'params':>9}{'grads':>9}{'optim':>9}{'act':>9}"
          f"{'act+SP':>9}{'total':>9}{'dp MB':>9}{'tp MB':>9}{'pp MB':>9}"
          + ("  fits" if memory_gb else ""))
    for r in rows:
        lay = r.layout
        fits = limit is None or r.total_bytes <= limit
        mark = " <-" if r is best else ""
        name = f"{lay.dp} x {lay.pp} x {lay.tp}" + (" rg" if lay.recompute_gather else "")
        print(f"{name:<13}{lay.zero_stage:>5}{_gb(r.params_bytes)}"
              f"{_gb(r.grads_bytes)}{_gb(r.optimizer_bytes)}{_gb(r.activation_bytes)}"
              f"{_gb(r.activation_sp_bytes)}{_gb(r.total_bytes)}{r.dp_sent_bytes / 1e6:9.1f}"
              f"{r.tp_sent_bytes / 1e6:9.1f}{r.pp_sent_bytes / 1e6:9.1f}"
              + (("  ok" if fits else "  -") if memory_gb else "") + mark)
    # tp degrees the vocabulary alone keeps out: a padded vocabulary lets them in.
    odd = [tp for tp in range(2, min(world_size, host) + 1)
           if world_size % tp == 0 and shape.n_head % tp == 0 and shape.vocab_size % tp]
    if odd:
        from ringtrain.cli.options import ModelOptions

        pad = math.lcm(*odd)
        padded = ModelOptions(pad_vocab=pad).vocab_rows(shape.vocab_size)  # as train pads
        print(f"not listed: tp {', '.join(map(str, odd))}, which divide{'s' * (len(odd) == 1)} "
              f"n_head but not vocab_size {shape.vocab_size}; `ringtrain train --pad-vocab {pad}"
              f"` pads the vocabulary to {padded} rows (`ringtrain plan --vocab-size {padded}` "
              "lists them)")
    if best is None:
        print(f"no layout fits in {memory_gb:g} GiB per rank: add ranks or memory, or "
              "--activation-checkpointing")
    else:
        lay = best.layout
        nodes = f" --nnodes {world_size // host}" if world_size > host else ""
        print(f"recommended: dp {lay.dp} x pp {lay.pp} x tp {lay.tp}"
              f"{f', ZeRO {lay.zero_stage}' if lay.zero_stage else ''}: ringtrain train "
              f"--nproc-per-node {host}{nodes} {lay.flags()}\nrule: {rule}")
    return best


def plan_rows(numel: int, world_size: int, root: int | None = None, block: int | None = None, *,
              stages: list[int] | None = None, boundary_bytes: float = 0.0) -> list[dict]:
    """Per strategy: bytes per rank held (params, grads, optimizer, working set, total), bytes
    sent per rank per step (`comm`) and, for the pipeline, its stages' parameters.

    Args:
        numel: the model's parameters.
        world_size: ranks.
        root, block: stage 3's units: the root's parameters and the biggest block's; None: the
            model is one unit (gathered whole while it computes).
        stages: parameters per pipeline stage (`gpt_stages`); None: no pipeline row.
        boundary_bytes: one step's activations crossing a stage boundary (the global batch x
            block_size x n_embd x 4 bytes); the gradients go back the same size.
    """
    n = world_size
    ring = (n - 1) / n * 4.0 * numel  # bytes a rank sends in one ring pass over all parameters
    rows = [{"strategy": "ddp", "params": 4.0 * numel, "grads": 4.0 * numel,
             "optimizer": 8.0 * numel, "working_set": 0.0, "comm": 2 * ring}]  # all-reduce
    for stage in (1, 2, 3):
        b = ZeroStrategy.bytes_per_rank(numel, n, stage)
        ws, comm = 0.0, 2 * ring  # reduce-scatter + all-gather: one all-reduce's bytes
        if stage == 3:
            one_unit = root is None or block is None
            ws = 4.0 * numel if one_unit else 4.0 * (root + 2 * block)
            kept = numel if one_unit else root  # the root stays gathered forward to backward
            comm = 3 * ring - (n - 1) / n * 4.0 * kept  # + the gather again before backward
        rows.append({"strategy": f"zero --zero-stage {stage}", **b, "working_set": ws,
                     "comm": comm})
    if stages is not None:
        heaviest = max(stages)
        rows.append({"strategy": f"pipeline --pp {n}", "params": 4.0 * heaviest,
                     "grads": 4.0 * heaviest, "optimizer": 8.0 * heaviest, "working_set": 0.0,
                     # a middle stage sends activations forward and gradients back
                     "comm": boundary_bytes * (2 if n > 2 else 1), "stages": stages})
    for r in rows:
        r["total"] = r["params"] + r["grads"] + r["optimizer"] + r["working_set"]
    return rows


def step_seconds(row: dict, numel: int, tokens: int, world_size: int, tflops: float,
                 link_gbit: float) -> float:
    """The time model: compute at `tflops` per rank plus `row['comm']` bytes at `link_gbit`.

    `tokens`: the global batch's tokens per step. Data parallel ranks each compute their
    share of all parameters; a pipeline's heaviest stage computes every token, and waits
    (pp - 1) micro-batches in the bubble of m = 4 x pp micro-batches.
    """
    flops = 6.0 * tokens / (tflops * 1e12)
    if "stages" in row:
        m = 4 * world_size
        compute = flops * max(row["stages"]) * (m + world_size - 1) / m
    else:
        compute = flops * numel / world_size
    return compute + row["comm"] * 8 / (link_gbit * 1e9)


def _gb(x: float) -> str:
    return f"{x / 2**30:9.3f}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ringtrain plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks sharing the model")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--params", type=parse_count, help="parameter count (instead of the shape)")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4,
                    help="attention heads: tp must divide them (the layout table)")
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8,
                    help="samples per step per data-parallel rank (the pipeline takes them all)")
    ap.add_argument("--memory-gb", type=float, help="memory per rank: say which strategies fit")
    ap.add_argument("--tflops", type=float, default=0.1,
                    help="compute per rank for the time model, in TFLOP/s (default: 0.1, a CPU)")
    ap.add_argument("--link-gbit", type=float, default=10.0,
                    help="bandwidth each rank sends at, in Gbit/s (default: 10)")
    return suggest_flags(ap)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) and USAGE_EXIT_CODE
    world = args.nproc_per_node * args.nnodes
    # Every figure of the command (counts, sizes, budgets, rates) must be positive.
    bad = [f"--{dest.replace('_', '-')} {value:g}" for dest, value in vars(args).items()
           if isinstance(value, int | float) and value <= 0]
    if bad:
        print(f"ringtrain plan: error: {', '.join(bad)}: "
              f"{'it' if len(bad) == 1 else 'each'} must be positive", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.params is not None:
        numel, root, block, stages = args.params, None, None, None
        shape = f"{numel:,} parameters (one unit, no pipeline split: give --n-layer ... for those)"
        boundary = 0.0
    else:
        try:
            cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        except ValueError as e:  # in the flags' words, as `ringtrain train` says it
            from ringtrain.cli.options import every_option_class
            from ringtrain.config import to_flags

            said = to_flags(str(e).removeprefix("GPTConfig: "), every_option_class())
            print(f"ringtrain plan: error: {said}", file=sys.stderr)
            return USAGE_EXIT_CODE
        numel, root, block = gpt_units(cfg)
        stages = gpt_stages(cfg, world)
        shape = (f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} vocab_size={cfg.vocab_size} "
                 f"block_size={cfg.block_size}: {numel:,} parameters")
        boundary = 4.0 * args.batch_size * world * args.block_size * args.n_embd
    tokens = args.batch_size * world * args.block_size
    rows = plan_rows(numel, world, root, block, stages=stages, boundary_bytes=boundary)
    print(f"{shape}; {world} ranks; fp32 AdamW; GiB per rank (activations not counted); global "
          f"batch {args.batch_size * world} x {args.block_size} tokens; time model: "
          f"{args.tflops:g} TFLOP/s per rank, {args.link_gbit:g} Gbit/s links")
    print(f"{'strategy':<22}{'params':>9} {'grads':>9} {'optim':>9} {'working':>9} {'total':>9}"
          f" {'sent MB':>9} {'step s':>8}" + ("  fits" if args.memory_gb else ""))
    best = None
    for r in rows:
        r["step_s"] = step_seconds(r, numel, tokens, world, args.tflops, args.link_gbit)
        fits = args.memory_gb is None or r["total"] <= args.memory_gb * 2**30
        # Equal times (DDP and ZeRO 1/2 send the same bytes): the one holding less wins.
        if fits and (best is None or (r["step_s"], r["total"]) < (best["step_s"], best["total"])):
            best = r
        print(f"{r['strategy']:<22}{_gb(r['params'])} {_gb(r['grads'])} {_gb(r['optimizer'])} "
              f"{_gb(r['working_set'])} {_gb(r['total'])} {r['comm'] / 1e6:9.1f} {r['step_s']:8.3f}"
              + (("  yes" if fits else "  no") if args.memory_gb else ""))
    if best is None:
        print(f"nothing fits in {args.memory_gb:g} GiB per rank: add ranks (zero --zero-stage 3 "
              "needs 16/N bytes per parameter) or memory")
    else:
        print(f"fastest{' that fits' if args.memory_gb else ''} by this model: {best['strategy']} "
              f"({best['step_s']:.3f} s per step)")
    if args.params is None:
        print_layouts(model_shape(cfg, world), world, args.nproc_per_node, args.batch_size,
                      args.memory_gb)
    return 0
