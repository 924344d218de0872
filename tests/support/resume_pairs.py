"""The resume table: a snapshot of each layout resumed by each other, against the target's own
uninterrupted run (`tests/test_portable_resume.py`; docs/train.md "Resuming in another layout").

    RINGTRAIN_FULL=1 PYTHONPATH=. .venv/bin/python -m tests.support.resume_pairs   # prints it

A layout is a strategy, its options and a world size. Each layout trains once without
interruption for `STEPS` steps, with a snapshot at step `STOP`; for a pair, a copy of the source
layout's run directory as it was at step `STOP` is resumed by the target layout up to `STEPS`,
and the steps after the snapshot are compared with the target's uninterrupted run: the logged
losses and the final parameters, bit for bit or by their largest difference. Every run keeps
the global batch (`GLOBAL_BATCH` samples over its data ranks) inside the first epoch, so each
step sees the same samples in every layout; no dropout, so the reseeded random generators do
not matter. A world size's runs share one start
of its ranks (`ringtrain.testing.run_workers`); one rank runs in the calling process.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STOP, STEPS, GLOBAL_BATCH = 3, 5, 12  # 60 of the 80 training samples: in one epoch
TOLERANCE = 1e-6  # the table's bound where the reduction order differs


@dataclass(frozen=True)
class Layout:
    """A strategy with its options on `world_size` ranks."""

    strategy: str
    world_size: int
    options: tuple[tuple[str, Any], ...] = ()
    data_ranks: int = field(default=0, compare=False)  # 0: world_size

    @property
    def label(self) -> str:
        o = dict(self.options)
        if self.strategy == "zero":
            name = f"zero{o['zero_stage']}"
        elif self.strategy == "pipeline":
            name = f"pp{o['pp']}" + (f"-{o['schedule']}" if o.get("schedule") else "")
            name += f"-v{o['virtual_stages']}" if o.get("virtual_stages", 1) > 1 else ""
        else:
            name = self.strategy
        return f"{name} x{self.world_size}"

    @property
    def dp(self) -> int:
        return self.world_size // dict(self.options).get("pp", 1)


def layouts(world_size: int) -> list[Layout]:
    """Every layout of the table on `world_size` ranks."""
    out = [Layout("ddp", world_size), *(Layout("zero", world_size, (("zero_stage", s),))
                                        for s in (1, 2, 3)),
           Layout("pipeline", world_size, (("pp", 1),))]
    if world_size % 2 == 0:
        out += [Layout("pipeline", world_size, (("pp", 2), ("schedule", s)))
                for s in ("1f1b", "gpipe", "zb-h1")]
        out.append(Layout("pipeline", world_size, (("pp", 2), ("schedule", "interleaved"),
                                                   ("virtual_stages", 2))))
    return out


def _trainer(layout: Layout, run_dir: Path, name: str):
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.runtime import get_runtime
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    model = GPTConfig(vocab_size=10, block_size=3, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    rt = get_runtime()
    cfg = TrainerConfig(steps=STEPS, batch_size=GLOBAL_BATCH // layout.dp, lr=1e-3, seed=0,
                        progress=False, log_every=1, eval_every=STEPS, eval_batch_size=10)
    return Trainer(make_strategy(layout.strategy, runtime=rt, **dict(layout.options)), rt,
                   lambda: GPT(model), AdditionDataset("train", 1), None, loss_fn, cfg,
                   run_dir=str(run_dir), snapshot_every=STOP, keep=3,
                   run_config={"n_embd": model.n_embd}, snapshot_timeout_s=30.0, name=name)


def _fit(layout: Layout, run_dir: Path, name: str) -> dict | None:
    """One run; rank 0 returns its final parameters (every rank takes part in gathering them)."""
    trainer = _trainer(layout, run_dir, name)
    trainer.fit()
    state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.model_state_dict().items()}
    trainer.strategy.close()
    return state if trainer.runtime.rank == 0 else None


def _run_dir(root: Path, layout: Layout, source: Layout | None = None) -> Path:
    name = layout.label.replace(" ", "")
    return root / (name if source is None else f"{source.label.replace(' ', '')}-to-{name}")


def _copy_until_stop(src: Path, dst: Path) -> None:
    """The source run as it was after step STOP: its later snapshots and summary removed (the
    resumed run drops the metrics lines after its snapshot itself)."""
    shutil.copytree(src, dst)
    (dst / "summary.json").unlink()
    for p in (dst / "snapshots").glob("snap-*"):
        if int(p.name[5:]) > STOP:
            shutil.rmtree(p)


def run_world(rank: int, world_size: int, root: str, references: list[Layout],
              pairs: list[tuple[Layout, Layout]]) -> dict[str, Any]:
    """On each rank of `world_size`: the uninterrupted run of each layout in `references` (it
    snapshots step STOP: it is the source of the pairs too), then each (source, target) pair;
    rank 0 returns the final parameters by run directory."""
    import ringtrain.training.report

    ringtrain.training.report.write_report = lambda *args, **kwargs: None  # matplotlib: slow
    base, out = Path(root), {}
    for layout in references:
        out[str(_run_dir(base, layout))] = _fit(layout, _run_dir(base, layout),
                                                f"ref-{layout.label}")
    for source, target in pairs:
        pair = _run_dir(base, target, source)
        if rank == 0:
            _copy_until_stop(_run_dir(base, source), pair)
        _barrier(world_size)
        out[str(pair)] = _fit(target, pair, f"pair-{source.label}-{target.label}")
    return out if rank == 0 else {}


def _barrier(world_size: int) -> None:
    import torch.distributed as dist

    if world_size > 1:
        dist.barrier()


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@dataclass
class Row:
    source: Layout
    target: Layout
    loss_diff: float
    param_diff: float
    resumed_from: list[int]

    @property
    def identical(self) -> bool:
        return self.loss_diff == 0.0 and self.param_diff == 0.0

    @property
    def result(self) -> str:
        if self.identical:
            return "bit-identical"
        return f"max diff {max(self.loss_diff, self.param_diff):.1e}"


def compare(root: Path, params: dict[str, Any], source: Layout, target: Layout) -> Row:
    """The pair's steps after the snapshot against the target's uninterrupted run."""
    pair, ref = _run_dir(root, target, source), _run_dir(root, target)
    a, b = losses(pair), losses(ref)
    after = list(range(STOP + 1, STEPS + 1))
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (a, b)
    loss_diff = max(abs(a[s] - b[s]) for s in after)
    pa, pb = params[str(pair)], params[str(ref)]
    assert pa.keys() == pb.keys()
    param_diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    summary = json.loads((pair / "summary.json").read_text())
    return Row(source, target, loss_diff, param_diff, summary["resumed_from_step"])


def table(rows: Iterable[Row]) -> str:
    lines = ["| source | target | result |", "|---|---|---|"]
    lines += [f"| {r.source.label} | {r.target.label} | {r.result} |" for r in rows]
    return "\n".join(lines)


def matrix(rows: Iterable[Row]) -> str:
    """The table of docs/train.md: source layout x target layout over every world size, each
    cell the largest difference of its pairs ("=": every one bit-identical), how many pairs,
    and how many of them bit-identical."""
    cells: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        key = (r.source.label.rsplit(" x", 1)[0], r.target.label.rsplit(" x", 1)[0])
        cells.setdefault(key, []).append(r)
    kinds = list(dict.fromkeys(k for key in cells for k in key))
    out = ["| source \\ target | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for s in kinds:
        shown = []
        for t in kinds:
            got = cells.get((s, t), [])
            same = sum(r.identical for r in got)
            worst = max((max(r.loss_diff, r.param_diff) for r in got), default=0.0)
            shown.append("-" if not got else f"= ({len(got)})" if same == len(got)
                         else f"{worst:.1e} ({len(got)}" + (f", {same} =)" if same else ")"))
        out.append(f"| {s} | " + " | ".join(shown) + " |")
    every = [r for got in cells.values() for r in got]
    out.append(f"\n{len(every)} pairs, {sum(r.identical for r in every)} bit-identical, largest "
               f"difference {max(max(r.loss_diff, r.param_diff) for r in every):.1e}")
    return "\n".join(out)


def run_table(root: Path, pairs: list[tuple[Layout, Layout]], *, in_process) -> dict[str, Any]:
    """Run every layout of `pairs` once and every pair: world sizes in ascending order (each
    one's layouts, then the pairs whose source has run), then descending for the pairs from a
    larger world. `in_process(fn, *args)` runs one rank in this process (world_size 1)."""
    from ringtrain.testing import run_workers

    sizes = sorted({ws for p in pairs for ws in (p[0].world_size, p[1].world_size)})
    layouts_of = {ws: list(dict.fromkeys(x for p in pairs for x in p if x.world_size == ws))
                  for ws in sizes}
    params: dict[str, Any] = {}
    for up in (True, False):
        for ws in (sizes if up else sizes[::-1]):
            todo = [(s, t) for s, t in pairs if t.world_size == ws
                    and (s.world_size <= ws if up else s.world_size > ws)]
            references = layouts_of[ws] if up else []
            if not todo and not references:
                continue
            if ws == 1:
                params.update(in_process(run_world, 0, 1, str(root), references, todo))
            else:
                params.update(run_workers(run_world, ws, args=(str(root), references, todo),
                                          timeout_s=600)[0])
    return params


def _in_process(fn, *args):
    from ringtrain.launch.process_group import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed()
    try:
        return fn(*args)
    finally:
        destroy_distributed()


def full_pairs(sizes: Iterable[int] = (1, 2, 3, 4)) -> list[tuple[Layout, Layout]]:
    every = [x for ws in sizes for x in layouts(ws)]
    return [(s, t) for s in every for t in every if s != t]


if __name__ == "__main__":
    import os
    import tempfile

    sizes = (1, 2, 3, 4) if os.environ.get("RINGTRAIN_FULL") == "1" else (1, 2)
    pairs = full_pairs(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        got = run_table(Path(tmp), pairs, in_process=_in_process)
        rows = [compare(Path(tmp), got, s, t) for s, t in pairs]
        print(table(rows))
        print()
        print(matrix(rows))
