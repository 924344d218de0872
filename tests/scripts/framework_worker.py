"""One rank of a Lightning or accelerate run, trained with torch's DDP and then ringtrain's.

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/scripts/framework_worker.py trainer manual --out DIR   # and RANK=1 beside it

tests/test_frameworks.py starts two (gloo, CPU), with torchrun's variables, so neither framework
spawns processes of its own. Each scenario trains twice in the same processes, on the same seed
and data: first with `torch.nn.parallel.DistributedDataParallel`, then with ringtrain's class put
where a user would put it before the framework builds its wrapper (torch.nn.parallel's name and
the name the framework imported: `swapped_ddp`). Several scenarios run one after another in the same
two processes (tests/test_frameworks.py runs all four in one pair: each pair of processes costs
~10 s of CPU in imports alone), each with its two runs and its own seeds. Every rank writes
DIR/<scenario>-rank<r>.json per scenario: per checkpoint of the run, the max abs difference of
the model's state (parameters and buffers) between the two runs, and which wrapper class each
run got. Scenarios (the checks in each):

- fabric: Fabric(strategy="ddp"), automatic loop, gradient accumulation by no_backward_sync.
- trainer: Trainer(strategy="ddp"), automatic optimization, a model with BatchNorm buffers;
  fit, save_checkpoint, then a new Trainer's fit(ckpt_path=...) for one more epoch. Its teardown
  reads `_get_ddp_logging_data()`.
- manual: Trainer(strategy="ddp"), manual optimization (reducer._rebuild_buckets and
  prepare_for_backward(loss)), then with find_unused_parameters=True and a head used every
  other step, then with static_graph=True (reducer._delay_all_reduce).
- accelerate: prepare, accumulate (no_sync), save_state / load_state (the resumed epoch equals
  the first try of it), trigger_sync_in_backward (require_forward_param_sync,
  prepare_for_backward([])).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's ringtrain

import ringtrain  # noqa: E402

# Where each framework bound torch's class at import (`from torch.nn.parallel.distributed import
# DistributedDataParallel`); accelerate looks up torch.nn.parallel's name at each call.
FRAMEWORK_NAMES = ("lightning.fabric.strategies.ddp", "lightning.pytorch.strategies.ddp",
                   "lightning.pytorch.overrides.distributed")
SAMPLES, BATCH = 32, 4  # 4 steps per epoch and rank


@contextlib.contextmanager
def swapped_ddp() -> Iterator[None]:
    """Point torch's DDP names at ringtrain's class, as a user would, and back afterwards."""
    homes = [torch.nn.parallel] + [sys.modules[m] for m in FRAMEWORK_NAMES if m in sys.modules]
    saved = [h.DistributedDataParallel for h in homes]
    for home in homes:
        home.DistributedDataParallel = ringtrain.DistributedDataParallel
    try:
        yield
    finally:
        for home, old in zip(homes, saved, strict=True):
            home.DistributedDataParallel = old


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def net(batch_norm: bool) -> nn.Sequential:
    torch.manual_seed(0)
    mid = [nn.BatchNorm1d(16)] if batch_norm else []
    return nn.Sequential(nn.Linear(8, 16), *mid, nn.Tanh(), nn.Linear(16, 1))


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def wrapper_name(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


# ---- Lightning -----------------------------------------------------------------------------

def fabric_run(record: Callable[[str, dict], None]) -> str:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    module = net(batch_norm=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH))
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            accumulating = i % 2 == 0  # two micro-batches per step
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(F.mse_loss(model(x), y))
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()
        record(f"epoch {epoch}", state(module))
    return wrapper_name(model._forward_module)


def _trainer(root: Path, strategy, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=root,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _lightning_module(batch_norm: bool, manual: bool, aux: bool):
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net(batch_norm)
            self.aux = nn.Linear(8, 1) if aux else None  # used on even steps only
            self.automatic_optimization = not manual
            self.wrapper = ""

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            if self.aux is not None and batch_idx % 2 == 0:
                loss = loss + 0.1 * self.aux(x).pow(2).mean()
            if not manual:
                return loss
            optimizer = self.optimizers()
            optimizer.zero_grad()  # set_to_none: the aux head's .grad is None on odd steps
            self.manual_backward(loss)
            optimizer.step()

        def on_train_start(self):
            self.wrapper = wrapper_name(self.trainer.strategy.model)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Regressor()


def trainer_run(record: Callable[[str, dict], None], root: Path, tag: str) -> str:
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    module = _lightning_module(batch_norm=True, manual=False, aux=False)
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer = _trainer(root, "ddp", max_epochs=1)
    trainer.fit(module, loader)  # its teardown reads _get_ddp_logging_data()
    record("fit 1 epoch", state(module))
    ckpt = root / f"{tag}.ckpt"
    trainer.save_checkpoint(ckpt)
    pl.seed_everything(0, verbose=False)
    resumed = _lightning_module(batch_norm=True, manual=False, aux=False)  # fresh weights
    _trainer(root, "ddp", max_epochs=2).fit(resumed, loader, ckpt_path=ckpt)
    record("resumed to epoch 2", state(resumed))
    return resumed.wrapper


def manual_run(record: Callable[[str, dict], None], root: Path, tag: str) -> str:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    wrappers = set()
    for name, strategy, aux in (
        ("manual", "ddp", False),
        ("manual, find_unused_parameters", DDPStrategy(find_unused_parameters=True), True),
        ("manual, static_graph", DDPStrategy(static_graph=True), False),
    ):
        pl.seed_everything(0, verbose=False)
        module = _lightning_module(batch_norm=False, manual=True, aux=aux)
        _trainer(root, strategy, max_epochs=2).fit(module, DataLoader(dataset(), batch_size=BATCH))
        record(name, state(module))
        wrappers.add(module.wrapper)
    assert len(wrappers) == 1, wrappers
    return wrappers.pop()


# ---- accelerate ----------------------------------------------------------------------------

def accelerate_run(record: Callable[[str, dict], None], root: Path, tag: str) -> str:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    module = net(batch_norm=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(module, optimizer,
                                                   DataLoader(dataset(), batch_size=BATCH))

    def epoch() -> None:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()

    epoch()
    record("accumulate, epoch 1", state(module))
    accelerator.save_state(root / f"{tag}-state")
    epoch()
    first_try = state(module)
    record("accumulate, epoch 2", first_try)
    accelerator.load_state(root / f"{tag}-state")
    record("load_state", state(module))
    epoch()
    again = state(module)
    assert all(torch.equal(again[k], first_try[k]) for k in again), \
        "epoch 2 after load_state differs from its first try"
    # Two forwards without sync, two backwards; the second syncs all that accumulated.
    x, y = next(iter(loader))
    with accelerator.no_sync(model):
        loss_a = F.mse_loss(model(x), y)
        loss_b = F.mse_loss(model(x.flip(0)), y.flip(0))
    accelerator.backward(loss_a)
    with accelerator.trigger_sync_in_backward(model):
        accelerator.backward(loss_b)
    assert accelerator.sync_gradients  # as the last accumulate() step left it: step() steps
    optimizer.step()
    optimizer.zero_grad()
    stepped = state(module)
    assert any(not torch.equal(stepped[k], again[k]) for k in again), "the step did nothing"
    record("trigger_sync_in_backward", stepped)
    return wrapper_name(model)


SCENARIOS = {"fabric": fabric_run, "trainer": trainer_run, "manual": manual_run,
             "accelerate": accelerate_run}
IMPORTS = {"fabric": "lightning.fabric", "trainer": "lightning.pytorch",
           "manual": "lightning.pytorch", "accelerate": "accelerate"}


def run_scenario(scenario: str, out: Path, rank: int) -> None:
    """Both runs of `scenario` (torch's DDP, then ringtrain's); writes its report."""
    t0 = time.perf_counter()
    importlib.import_module(IMPORTS[scenario])  # binds its names in FRAMEWORK_NAMES
    import_s = time.perf_counter() - t0

    run = SCENARIOS[scenario]
    results: dict[str, dict] = {}
    wrappers, times = {}, {}
    for impl in ("torch", "ringtrain"):
        checkpoints: dict[str, dict] = {}

        def record(name: str, sd: dict, checkpoints=checkpoints) -> None:
            checkpoints[name] = sd

        t = time.perf_counter()
        swap = swapped_ddp() if impl == "ringtrain" else contextlib.nullcontext()
        with swap:
            if scenario == "fabric":
                wrappers[impl] = run(record)
            else:
                wrappers[impl] = run(record, out, impl)
        times[impl] = round(time.perf_counter() - t, 2)
        results[impl] = checkpoints
    diffs = {}
    for name, ref in results["torch"].items():
        got = results["ringtrain"][name]
        assert ref.keys() == got.keys(), (name, sorted(ref), sorted(got))
        diffs[name] = max((ref[k].double() - got[k].double()).abs().max().item() for k in ref)
    report = {"scenario": scenario, "rank": rank, "wrappers": wrappers, "max_abs_diff": diffs,
              "bitwise": {n: all(torch.equal(results["torch"][n][k], results["ringtrain"][n][k])
                                 for k in results["torch"][n]) for n in diffs},
              "import_s": round(import_s, 2), "run_s": times}
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"rank {rank}: {json.dumps(report)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    for scenario in args.scenarios:
        run_scenario(scenario, args.out, rank)


if __name__ == "__main__":
    main()
