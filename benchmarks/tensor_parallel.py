"""Tensor parallelism by layout: bytes per step against the formulas, memory per rank, step time.

    .venv/bin/python benchmarks/tensor_parallel.py            # GPT 4 x 256, batch 4 x 256
    .venv/bin/python benchmarks/tensor_parallel.py --quick    # GPT 2 x 64, batch 4 x 64

Layouts, side by side in one run (gloo ranks on this machine, one thread each):
- tp 1 (the plain GPT in one process); tp 2 and tp 4, each without sequence parallelism, with
  it, and with it and `recompute_gather` (the column layers save their input's shard and
  all-gather it again in backward): `parallelize(GPT, gpt_plan(...))` over the world;
- dp 2 x tp 2 on 4 ranks, plain, with sequence parallelism, and with it and ZeRO 1 on the dp
  axis: `--strategy tp` itself (`ringtrain.strategies.tp.TPStrategy`), one `train_step` each;
- tp 2 x pp 2 on the same 4 ranks, 1F1B, plain and with sequence parallelism: `--strategy
  pipeline --pp 2 --tp 2` itself (`PipelineStrategy`), a row for each stage (rank 0, rank 2).
Reported per layout, on rank 0 (and rank 2 for the pipeline's second stage):
- `tp_counted` against `tp_formula`: the bytes of each collective over the tp group in one step
  (each call's whole tensor), counted by wrapping torch.distributed's calls (and
  `comm.reduce_scatter`: on gloo a send/recv ring), next to
  `ringtrain.tensor_parallel.expected_bytes`: equal to the byte;
- `sent_counted` against `sent_formula`: the bytes this rank sends per step on each axis, the
  collectives' by ring (2(t-1)/t of an all-reduce, (t-1)/t of the others) and ZeRO's rings'
  and the pipeline's `isend`s as counted, next to `ringtrain plan`'s formula
  (`strategies.layouts`; a pipeline stage's tp bytes: `expected_bytes` of its own layers, with
  the embedding on the first stage and the head on the last, `layouts.pp_sent_bytes` on pp);
- `saved_mb` against `saved_formula_mb`: bytes autograd keeps for backward at the end of one
  forward + loss (`ringtrain.pipeline.memory.ActivationMeter`: each saved storage once,
  parameters not at all; a pipeline stage: the most held at once over a 1F1B step, the
  engine's `measure_memory`), next to `tensor_parallel.volumes.activation_bytes` (a stage's:
  `ringtrain plan`'s bound, the head counted on every stage);
- `state_mb` against `state_formula_mb`: parameters, gradients and AdamW state this rank holds
  in the step (counted from the tensors; ZeRO's from `ZeroDataParallel.memory`);
- `step_ms`: the median of `--steps` steps; on a 2-core machine more ranks than cores only
  shows the overhead, not a speed-up.
A table, then the last line printed is JSON.
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

from ringtrain.cli.plan import model_shape
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.pipeline.memory import ActivationMeter
from ringtrain.runtime import get_runtime
from ringtrain.strategies.figures import ADAMW_BYTES, FP32_BYTES
from ringtrain.strategies.layouts import (
    Layout,
    ModelShape,
    layout_figures,
    pp_sent_bytes,
    whole_numel,
)
from ringtrain.strategies.pipeline import PipelineStrategy
from ringtrain.strategies.pipeline_config import default_microbatches
from ringtrain.strategies.tp import TPStrategy
from ringtrain.tensor_parallel import comm, expected_bytes, gpt_plan, parallelize
from ringtrain.tensor_parallel import vocab_parallel_cross_entropy as vp_loss
from ringtrain.tensor_parallel.volumes import activation_bytes, ring_bytes_per_rank
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw

COLLECTIVES = {"all_reduce": ("all_reduce", 0), "all_gather_into_tensor": ("all_gather", 0),
               "all_gather_single": ("all_gather", 0),
               "reduce_scatter_tensor": ("reduce_scatter", 1),
               "reduce_scatter_single": ("reduce_scatter", 1), "isend": ("isend", 0)}
MIB = 2**20


class Counter:
    """Bytes of torch.distributed's calls by group and op while `counting()` (one step)."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = {}
        self._inside = 0  # > 0 inside tensor parallelism's reduce-scatter (counted as one)

    def _add(self, group, op: str, t: torch.Tensor, groups) -> None:
        if self._inside:
            return
        name = next((name for name, g in groups.items() if group is g or
                     (g is None and group in (None, dist.group.WORLD))), "other")
        self.bytes[name, op] = self.bytes.get((name, op), 0) + t.numel() * t.element_size()

    def counting(self, groups: dict[str, dist.ProcessGroup | None]):
        """Wrap the calls; `groups` names the process groups (None: the world)."""
        real = {(dist, n): getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for (_, name), fn in real.items():
            op, which = COLLECTIVES[name]

            def wrapper(*args, _fn=fn, _op=op, _which=which, **kwargs):
                self._add(kwargs.get("group"), _op, args[_which], groups)
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapper)
        # On gloo tensor parallelism's reduce-scatter is a send/recv ring (`ringtrain.rings`),
        # whose isends would count as such: counted here as one reduce-scatter of its whole
        # input, as torch's call is, and the calls inside it not at all.
        real[comm, "reduce_scatter"] = rs = comm.reduce_scatter

        def reduce_scatter(x, dim, group):
            self._add(group, "reduce_scatter", x, groups)
            self._inside += 1
            try:
                return rs(x, dim, group)
            finally:
                self._inside -= 1
        comm.reduce_scatter = reduce_scatter
        return real

    @staticmethod
    def restore(real) -> None:
        for (module, name), fn in real.items():
            setattr(module, name, fn)

    def of(self, axis: str) -> dict[str, int]:
        return {op: b for (a, op), b in self.bytes.items() if a == axis}

    def sent(self, axis: str, size: int) -> float:
        """What this rank sent on `axis` (a group of `size` ranks), collectives by ring."""
        return sum(b if op == "isend" else ring_bytes_per_rank(op, b, size)
                   for op, b in self.of(axis).items())


def _shape(config: GPTConfig) -> ModelShape:
    with torch.device("meta"):
        model = GPT(config)
    return ModelShape(config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                      config.block_size, sum(p.numel() for p in model.parameters()),
                      whole_numel(model))


def _batch(config: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g),
            torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g))


def _formulas(row: dict, config: GPTConfig, batch: int, layout: Layout, rg: bool) -> dict:
    """`ringtrain plan`'s figures of the layout, and the whole tensors tp's collectives move."""
    f = layout_figures(layout, _shape(config), batch=batch)
    sp = layout.sequence_parallel
    saved = activation_bytes(n_layer=config.n_layer, n_embd=config.n_embd, batch=batch,
                             seq=config.block_size, vocab_size=config.vocab_size, tp=layout.tp,
                             sequence_parallel=sp, recompute_gather=rg)
    tp = (expected_bytes(n_layer=config.n_layer, n_embd=config.n_embd, batch=batch,
                         seq=config.block_size, sequence_parallel=sp, recompute_gather=rg)
          if layout.tp > 1 else {})
    # `recompute_gather` is not a layout of `ringtrain plan`: its rows sum the ring shares.
    tp_sent = (sum(ring_bytes_per_rank(op, b, layout.tp) for op, b in tp.items()) if rg
               else f.tp_sent_bytes)
    return {**row, "tp_formula": {k: v for k, v in tp.items() if v},
            "sent_formula": {"tp": round(tp_sent), "dp": round(f.dp_sent_bytes)},
            "saved_formula_mb": round(saved / MIB, 2),
            "state_formula_mb": round(f.state_bytes / MIB, 3)}


def _plain(world_size: int, config: GPTConfig, batch: int, sp: bool, rg: bool,
           steps: int) -> dict:
    """tp = world_size (1: the plain GPT) by `parallelize`, AdamW by hand."""
    torch.manual_seed(0)
    model = GPT(config)
    group = dist.group.WORLD if world_size > 1 else None
    if group is not None:
        model = parallelize(copy.deepcopy(model), gpt_plan(sequence_parallel=sp,
                                                           recompute_gather=rg), group)

    def loss_of(idx, targets):
        logits = model(idx)
        return loss_fn(logits, targets) if group is None else vp_loss(logits, targets, group)

    idx, targets = _batch(config, batch)
    meter = ActivationMeter(model)
    with meter.saving(0):
        loss = loss_of(idx, targets)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter, times = Counter(), []
    for step in range(steps + 1):
        real = counter.counting({"tp": None}) if step == 0 and group is not None else {}
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_of(idx, targets).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        Counter.restore(real)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if t.dim() > 0)  # the moments; AdamW's step scalars left out
    row = {"layout": f"tp {world_size}" + (" +SP" if sp else "") + (" +recompute" if rg else ""),
           "tp_counted": counter.of("tp"),
           "sent_counted": {"tp": round(counter.sent("tp", world_size)), "dp": 0},
           "saved_mb": round(meter.peak / MIB, 2),
           "state_mb": round((2 * params + optim) / MIB, 3),
           "step_ms": round(1e3 * statistics.median(times[1:]), 1)}
    return _formulas(row, config, batch, Layout(1, 1, world_size, 0, sp), rg)


def _strategy(world_size: int, config: GPTConfig, batch: int, sp: bool, zero: int,
              steps: int) -> dict:
    """dp 2 x tp 2 (`--strategy tp`), one `train_step` per step, no clipping."""
    torch.manual_seed(0)
    s = TPStrategy(get_runtime(), tp=2, sequence_parallel=sp, zero_stage=zero)
    s.setup(GPT(config), adamw(0.0), loss_fn)
    dp = s.data_world_size
    idx, targets = _batch(config, batch * dp)
    mine = (idx[s.data_rank::dp], targets[s.data_rank::dp])
    forward = s.zero or s.module
    meter = ActivationMeter(s.module)
    with meter.saving(0):
        s.loss_fn(forward(mine[0]), mine[1])
    counter, times = Counter(), []
    groups = {"tp": s.groups.tp_group, "dp": s.groups.dp_group}
    for step in range(steps + 1):
        real = counter.counting(groups) if step == 0 else {}
        t0 = time.perf_counter()
        s.train_step([mine], lr=1e-3, grad_clip=None)
        times.append(time.perf_counter() - t0)
        Counter.restore(real)
    if s.zero is not None:
        held = s.stats()
        state = held["zero_param_bytes"] + held["zero_grad_bytes"] + held["zero_optimizer_bytes"]
    else:  # the gradients live through the step: as many bytes as the parameters
        params = sum(p.numel() * p.element_size() for p in s.module.parameters())
        state = 2 * params + sum(t.numel() * t.element_size() for st in s.optimizer.state.values()
                                 for t in st.values() if t.dim() > 0)
    row = {"layout": f"dp {dp} x tp 2" + (" +SP" if sp else "") + (f" +ZeRO {zero}" if zero
                                                                    else ""),
           "tp_counted": {k: v for k, v in counter.of("tp").items() if v},
           "sent_counted": {"tp": round(counter.sent("tp", 2)),
                            "dp": round(counter.sent("dp", dp))},
           "saved_mb": round(meter.peak / MIB, 2), "state_mb": round(state / MIB, 3),
           "step_ms": round(1e3 * statistics.median(times[1:]), 1)}
    s.close()
    return _formulas(row, config, batch, Layout(dp, 1, 2, zero, sp), False)


def _pipeline(config: GPTConfig, batch: int, sp: bool, steps: int) -> dict:
    """tp 2 x pp 2 on 4 ranks (`--strategy pipeline --pp 2 --tp 2`, 1F1B), one `train_step` per
    step, no clipping; the figures of this rank's stage."""
    torch.manual_seed(0)
    s = PipelineStrategy(get_runtime(), pp=2, schedule="1f1b", tp=2, sequence_parallel=sp)
    s.setup(GPT(config), adamw(0.0), loss_fn)
    idx, targets = _batch(config, batch)
    m = default_microbatches(batch, 2)
    # A first step by the engine itself: its dry run (the boundary shapes) stays out of the
    # counted step, and it measures the most bytes saved at once.
    s.engine.measure_memory = True
    peak = s.engine.train_step(idx, targets, m).peak_activation_bytes
    s.engine.measure_memory = False
    counter, times = Counter(), []
    groups = {"tp": s.groups.tp_group, "pp": s.groups.pp_group, "dp": s.groups.dp_group}
    for step in range(steps + 1):
        real = counter.counting(groups) if step == 0 else {}
        t0 = time.perf_counter()
        s.train_step([(idx, targets)], lr=1e-3, grad_clip=None)
        times.append(time.perf_counter() - t0)
        Counter.restore(real)
    params = sum(p.numel() * p.element_size() for p in s.stage.parameters())
    state = 2 * params + sum(t.numel() * t.element_size() for st in s.optimizer.state.values()
                             for t in st.values() if t.dim() > 0)
    k, layout = s.groups.pp_rank, Layout(1, 2, 2, 0, sp)
    row = {"layout": "tp 2 x pp 2" + (" +SP" if sp else "") + f" stage {k}",
           "tp_counted": {op: b for op, b in counter.of("tp").items() if b},
           "sent_counted": {"tp": round(counter.sent("tp", 2)), "pp": round(counter.sent("pp", 2)),
                            "dp": round(counter.sent("dp", 1))},
           "other_counted": counter.of("other"),
           "saved_mb": round(peak / MIB, 2), "state_mb": round(state / MIB, 3),
           "step_ms": round(1e3 * statistics.median(times[1:]), 1)}
    s.close()
    # This stage's formulas: its own layers, the embedding on the first, the head on the last.
    shape = model_shape(config, 4)
    n, whole, layers = shape.stages[2][k]
    tp = expected_bytes(n_layer=layers, n_embd=config.n_embd, batch=batch,
                        seq=config.block_size, sequence_parallel=sp, embedding=k == 0,
                        head=k == 1, backwards=m)
    held = (n - whole) / 2 + whole
    in_flight = min(2 - k, m) * batch / m  # 1F1B: stage k holds pp - k micro-batches at most
    saved = activation_bytes(n_layer=layers, n_embd=config.n_embd, batch=in_flight,
                             seq=config.block_size, vocab_size=config.vocab_size, tp=2,
                             sequence_parallel=sp)  # the head counted on every stage: a bound
    return {**row, "tp_formula": {op: b for op, b in tp.items() if b},
            "sent_formula": {"tp": round(sum(ring_bytes_per_rank(op, b, 2)
                                             for op, b in tp.items())),
                             "pp": round(pp_sent_bytes(layout, shape, batch=batch)), "dp": 0},
            "saved_formula_mb": round(saved / MIB, 2),
            "state_formula_mb": round((2 * FP32_BYTES + ADAMW_BYTES) * held / MIB, 3)}


def _worker(rank: int, world_size: int, config: GPTConfig, batch: int, steps: int) -> list:
    torch.set_num_threads(1)
    rows = [_plain(world_size, config, batch, sp, rg, steps)
            for sp, rg in ((False, False), (True, False), (True, True))]
    if world_size == 4:
        rows += [_strategy(world_size, config, batch, sp, zero, steps)
                 for sp, zero in ((False, 0), (True, 0), (True, 1))]
        rows += [_pipeline(config, batch, sp, steps) for sp in (False, True)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT 2 x 64, batch 4 x 64")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        config, batch = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4,
                                  n_embd=64), 4
    else:
        config, batch = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8,
                                  n_embd=256), 4
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = [_plain(1, config, batch, False, False, args.steps)]
    for world in (2, 4):  # one worker start per world size, its layouts in turn
        ranks = run_workers(_worker, world, args=(config, batch, args.steps), timeout_s=600)
        rows += ranks[0]
        if world == 4:  # rank 2: tp rank 0 of the pipeline's second stage
            rows += [r for r in ranks[2] if "stage 1" in r["layout"]]
    print(f"{'layout':<26}{'tp bytes = formula':>19}{'sent MB (formula)':>20}{'pp = formula':>14}"
          f"{'saved MiB (formula)':>21}{'state MiB (formula)':>21}{'step ms':>9}")
    for r in rows:
        equal = "-" if not r["tp_formula"] else str(r["tp_counted"] == r["tp_formula"])
        sent = sum(r["sent_counted"].values()) / 1e6
        sent_f = sum(r["sent_formula"].values()) / 1e6
        pp = r["sent_counted"].get("pp")
        pp = "-" if pp is None else str(pp == r["sent_formula"]["pp"])  # equal to the byte
        saved = "{saved_mb:.2f} ({saved_formula_mb:.2f})".format(**r)
        state = "{state_mb:.3f} ({state_formula_mb:.3f})".format(**r)
        print(f"{r['layout']:<26}{equal:>19}{f'{sent:.3f} ({sent_f:.3f})':>20}{pp:>14}"
              f"{saved:>21}{state:>21}{r['step_ms']:9.1f}")
    print(json.dumps({"config": {"n_layer": config.n_layer, "n_embd": config.n_embd,
                                 "n_head": config.n_head, "vocab_size": config.vocab_size,
                                 "batch": batch, "seq": config.block_size},
                      "layouts": rows, "loadavg_before": load, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
