"""ringtrain's tensor parallelism next to torch's own (DTensor `parallelize_module`), same work.

    .venv/bin/python benchmarks/tp_vs_torch.py            # GPT 4 x 256, 8 heads, batch 8 x 128
    .venv/bin/python benchmarks/tp_vs_torch.py --quick    # GPT 2 x 64, batch 4 x 32 (~15 s)

Two ranks (gloo, one thread each) hold one GPT split tp = 2, both ways in the same processes,
from the same weights and on the same batch:
- ours: `parallelize(GPT, gpt_plan(sp))` and `vocab_parallel_cross_entropy`, plain tensors;
- torch's: `parallelize_module` with torchtitan's plan for a Llama, applied to the same GPT:
  q, k, v ColwiseParallel, the attention's output and the MLP's second layer RowwiseParallel,
  the token embedding RowwiseParallel (vocab-sharded), the lm_head ColwiseParallel with its
  logits left vocab-sharded for `loss_parallel`; with sequence parallelism the norms are
  SequenceParallel, attention and MLP take their input through PrepareModuleInput (all-gather)
  and their row layers reduce-scatter, and the embedding's output is split along the sequence
  (PrepareModuleOutput), as ours does. Norms and the position embedding are replicated.
  One change to the model: its fused q, k, v layer is cut into three layers (a ColwiseParallel
  shard of the fused matrix would give rank 0 all of q and half of k), with the same weights;
  the attention views its heads as `-1` (n_head / t on each rank).
Each step is zero_grad, forward, loss, backward, AdamW (torch's default: foreach for both);
the two alternate which goes first. Reported: the median step of each, ours / torch's, the
loss at every step on both (equal within 1e-5: the same training), and the load before/after.
A table, then the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringtrain.models import GPT, GPTConfig  # noqa: E402
from ringtrain.tensor_parallel import gpt_plan, parallelize  # noqa: E402
from ringtrain.tensor_parallel import vocab_parallel_cross_entropy as vp_loss  # noqa: E402
from ringtrain.testing import run_workers  # noqa: E402

FULL = {"config": dict(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=256),
        "batch": 8, "steps": 20}
QUICK = {"config": dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64),
         "batch": 4, "steps": 6}
WARMUP = 3


class SplitQKV(nn.Module):
    """The GPT's attention with q, k and v as three layers (torchtitan's Llama layout), the
    fused layer's weights copied; heads viewed as -1, so a rank holding n_head / t runs."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        c = attn.c_proj.in_features
        self.head_dim = c // attn.n_head
        fused = attn.c_attn
        self.q, self.k, self.v = (nn.Linear(c, c, bias=fused.bias is not None) for _ in range(3))
        with torch.no_grad():
            for i, layer in enumerate((self.q, self.k, self.v)):
                layer.weight.copy_(fused.weight[i * c:(i + 1) * c])
                if fused.bias is not None:
                    layer.bias.copy_(fused.bias[i * c:(i + 1) * c])
        self.c_proj = attn.c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q, k, v = (layer(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


def torch_tp(model: GPT, sp: bool) -> nn.Module:
    """`model` with split q, k, v, parallelized by torch's DTensor over the world."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for block in model.blocks:
        block.attn = SplitQKV(block.attn)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    seq = Shard(1)
    row_out = {"output_layouts": seq} if sp else {}
    gather_in = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    plan = {"embed.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head.lm_head": ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                            output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan |= {"embed": PrepareModuleOutput(output_layouts=(Replicate(),),
                                              desired_output_layouts=(seq,)),
                 "head.ln_f": SequenceParallel()}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(),
                 f"{b}.attn.v": ColwiseParallel(), f"{b}.attn.c_proj": RowwiseParallel(**row_out),
                 f"{b}.mlp.0": ColwiseParallel(), f"{b}.mlp.2": RowwiseParallel(**row_out)}
        if sp:
            plan |= {f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel(),
                     f"{b}.attn": gather_in, f"{b}.mlp": gather_in}
    return parallelize_module(model, mesh, plan)


def _worker(rank: int, world_size: int, config: dict, batch: int, steps: int,
            sp: bool) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**config))
    ours = parallelize(copy.deepcopy(gpt), gpt_plan(sequence_parallel=sp), dist.group.WORLD)
    theirs = torch_tp(copy.deepcopy(gpt), sp)
    q = theirs.blocks[0].attn.q.weight  # a DTensor whose local part is this rank's heads
    assert q.to_local().shape[0] * world_size == q.shape[0] == config["n_embd"], q.placements
    g = torch.Generator().manual_seed(1)
    shape = (batch, config["block_size"])
    idx = torch.randint(0, config["vocab_size"], shape, generator=g)
    targets = torch.randint(0, config["vocab_size"], shape, generator=g)

    def step_ours(opt) -> float:
        opt.zero_grad()
        loss = vp_loss(ours(idx), targets, dist.group.WORLD)
        loss.backward()
        opt.step()
        return loss.item()

    def step_theirs(opt) -> float:
        opt.zero_grad()
        logits = theirs(idx)
        with loss_parallel():  # the vocab-sharded logits' loss, as ours: never gathered
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    runs = {"ours": (step_ours, torch.optim.AdamW(ours.parameters(), lr=1e-3)),
            "torch": (step_theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3))}
    ms: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(WARMUP + steps):
        order = list(runs) if step % 2 == 0 else list(runs)[::-1]
        for name in order:
            fn, opt = runs[name]
            dist.barrier()  # both ranks start each timed step together
            t0 = time.perf_counter()
            loss = fn(opt)
            ms[name].append(1e3 * (time.perf_counter() - t0))
            losses[name].append(loss)
    return {name: {"step_ms": round(statistics.median(ms[name][WARMUP:]), 2),
                   "losses": losses[name]} for name in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT, a few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per layout")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    steps = args.steps or size["steps"]
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    for sp in (False, True):
        r0 = run_workers(_worker, 2, args=(size["config"], size["batch"], steps, sp),
                         timeout_s=900)[0]
        diff = max(abs(a - b) for a, b in zip(r0["ours"]["losses"], r0["torch"]["losses"],
                                              strict=True))
        rows.append({"layout": "tp 2" + (" +SP" if sp else ""),
                     "ours_ms": r0["ours"]["step_ms"], "torch_ms": r0["torch"]["step_ms"],
                     "ratio": round(r0["ours"]["step_ms"] / r0["torch"]["step_ms"], 3),
                     "loss_first": r0["ours"]["losses"][0], "loss_last": r0["ours"]["losses"][-1],
                     "loss_max_diff": diff})
    print(f"{'layout':10} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'loss max diff':>14}")
    for r in rows:
        print(f"{r['layout']:10} {r['ours_ms']:9.1f} {r['torch_ms']:9.1f} {r['ratio']:6.3f} "
              f"{r['loss_max_diff']:14.2e}")
    print(json.dumps({"benchmark": "tp_vs_torch", "torch": torch.__version__,
                      "config": size["config"], "batch": size["batch"], "steps": steps,
                      "warmup": WARMUP, "rows": rows, "load_before": round(load_before, 2),
                      "load_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
