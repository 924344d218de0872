"""ZeRO's background snapshots: the moments and stage 3's shard are copied beside the next step
(`ZeroStrategy.updated_state`), and what lands is byte for byte what a synchronous save writes.

The reference is the synchronous save (every tensor copied, or written, in the snapshot's step).
Two ranks, gloo on the CPU, stages 1-3 in one worker start:
`.venv/bin/pytest -q tests/test_zero_updated_state.py`.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch
from torch.utils.data import Subset

from ringtrain.testing import run_workers


def _trainer(run_dir: Path, stage: int, *, steps: int, sync: bool, name: str = "trainer"):
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.runtime import get_runtime
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    rt = get_runtime()
    model = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=32, dropout=0.1)
    cfg = TrainerConfig(steps=steps, batch_size=8, seed=0, progress=False, log_every=1,
                        eval_every=4)
    strategy = make_strategy("zero", runtime=rt, zero_stage=stage)
    return strategy, Trainer(strategy, rt, lambda: GPT(model), AdditionDataset("train", 1),
                             Subset(AdditionDataset("test", 1), range(5)), loss_fn, cfg,
                             run_dir=str(run_dir), snapshot_every=2, sync_snapshots=sync,
                             name=name)


def _files(run_dir: Path, rank: int) -> dict[str, str]:
    """Each committed snapshot's checksum of this rank's file (its ZeRO part: shards, moments),
    newest first."""
    snaps = sorted((run_dir / "snapshots").glob("snap-*"), reverse=True)
    return {s.name: hashlib.sha256((s / f"rank{rank}.pt").read_bytes()).hexdigest()
            for s in snaps}


def _stages(rank: int, world_size: int, root: str) -> list[tuple]:
    import ringtrain.training.report
    ringtrain.training.report.write_report = lambda *a, **k: None
    out = []
    for stage in (1, 2, 3):
        sync_dir, bg_dir = Path(root, f"sync{stage}"), Path(root, f"bg{stage}")
        sync_sha = _trainer(sync_dir, stage, steps=4, sync=True)[1].fit()["param_sha256"]
        strategy, trainer = _trainer(bg_dir, stage, steps=4, sync=False)
        bg_sha = trainer.fit()["param_sha256"]
        # The deferred copy is taken: the optimizer's moments are views of the declared buffers.
        declared = {t.untyped_storage().data_ptr() for t in strategy.updated_state().tensors}
        opt = strategy._zero().optimizer.optimizer
        moments = [v for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() >= 1]
        viewed = bool(moments) and all(v.untyped_storage().data_ptr() in declared
                                       for v in moments)
        files = _files(bg_dir, rank)
        torch.distributed.barrier()  # every rank has read the files before rank 0 drops one
        if rank == 0:  # resume from the background snapshot of step 2
            shutil.rmtree(bg_dir / "snapshots" / "snap-00000004")
        torch.distributed.barrier()
        resumed = _trainer(bg_dir, stage, steps=4, sync=False, name="resumed")[1].fit()
        out.append((stage, viewed, files, _files(sync_dir, rank), bg_sha,
                    resumed["param_sha256"], sync_sha))
    return out


def test_zero_background_snapshots_are_the_sync_files_and_resume_to_its_params(tmp_path):
    results = run_workers(_stages, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, per_stage in enumerate(results):
        for stage, viewed, files, sync, bg_sha, resumed, sync_sha in per_stage:
            where = f"rank {rank} stage {stage}"
            assert viewed, where
            assert list(sync) == ["snap-00000004", "snap-00000002"], (where, sync)
            assert files == sync, where
            assert bg_sha == resumed == sync_sha, where
