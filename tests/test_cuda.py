"""The GPU tier: what a user's GPU box runs, each against a reference on the same device.

Skipped, saying so, where torch sees no GPU (tests/conftest.py); every other test file means
the CPU. Two ranks share one GPU over gloo here (`--backend gloo --device cuda`), so one GPU is
enough for every multi-process case; NCCL runs with a rank per GPU.

    .venv/bin/pytest -q -m cuda tests/test_cuda.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ringtrain.checkpoint.rng import get_rng_state, set_rng_state
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.launch.device import cuda_device_count
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw
from ringtrain.zero import ZeroDataParallel

pytestmark = pytest.mark.cuda

MODEL = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
B, STEPS, LR = 4, 4, 1e-2
TINY = ["--steps", "6", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "16",
        "--eval-every", "6", "--no-progress", "--no-report"]


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # on the CPU: the same data on every device
    x = torch.randint(0, MODEL.vocab_size, (world_size * B, MODEL.block_size), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _reference(world_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, a plain loop."""
    torch.manual_seed(0)
    model = GPT(MODEL).to(device)
    opt = adamw(0.1)(model.parameters())
    for group in opt.param_groups:
        group["lr"] = LR
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step, world_size))
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _data_parallel(rank: int, world_size: int, kind: str) -> dict[str, torch.Tensor]:
    device = get_runtime().device
    assert device.type == "cuda", device
    torch.manual_seed(0)
    model = GPT(MODEL).to(device)
    if kind == "ddp":
        wrapped = DistributedDataParallel(model, device_ids=[device])
        opt = adamw(0.1)(model.parameters())
    else:  # zero-1, zero-2, zero-3: its rings carry CUDA tensors through host memory on gloo
        wrapped = ZeroDataParallel(model, adamw(0.1), stage=int(kind[-1]))
        opt = wrapped.optimizer
    for group in opt.param_groups:
        group["lr"] = LR
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        x, y = x[rank * B:(rank + 1) * B].to(device), y[rank * B:(rank + 1) * B].to(device)
        loss_fn(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict() if kind == "ddp" else wrapped.full_state_dict()
    return {k: v.cpu() for k, v in state.items()}


@pytest.mark.parametrize("kind", ["ddp", "zero-1", "zero-2", "zero-3"])
def test_two_ranks_sharing_a_gpu_over_gloo_equal_one_process(kind):
    results = run_workers(_data_parallel, 2, args=(kind,), device="cuda", timeout_s=180)
    ref = _reference(2, torch.device("cuda", 0))
    for k, v in ref.items():
        assert torch.equal(results[0][k], results[1][k]), k  # the replicas agree bit for bit
        # Half the batch per rank: other kernels' summation order, so close, not equal.
        assert torch.allclose(results[0][k], v, rtol=1e-3, atol=1e-4), k


def test_nccl_with_world_size_one_places_the_rank_on_its_gpu(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    try:
        rt = init_distributed()  # auto on a GPU box
        assert (rt.backend, rt.device) == ("nccl", torch.device("cuda", 0))
        model = DistributedDataParallel(GPT(MODEL).to(rt.device), device_ids=[rt.device])
        x, y = (t.to(rt.device) for t in _batch(0, 1))
        loss_fn(model(x), y).backward()
        assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
    finally:
        destroy_distributed()


def _cpu_model_under_nccl(rank: int, world_size: int) -> tuple[str, list[str | None]]:
    # NCCL builds its communicator at the first collective (the default group here is gloo,
    # bound to no device): two ranks on one GPU can hold the group as long as nothing is sent.
    import torch.distributed as dist

    group = dist.new_group(backend="nccl")
    said: list[str | None] = []
    for make in (lambda: DistributedDataParallel(torch.nn.Linear(2, 2), process_group=group),
                 lambda: ZeroDataParallel(torch.nn.Linear(2, 2), adamw(0.1),
                                          process_group=group)):
        try:
            make()
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return dist.get_backend(group), said


def test_a_cpu_model_under_nccl_is_refused_before_any_collective():
    """ctor_args.check_backend_devices on a real NCCL group (the CPU tests report a gloo group
    as nccl): the CPU model is named, nothing is sent (two ranks share one GPU)."""
    for backend, said in run_workers(_cpu_model_under_nccl, 2, device="cuda", timeout_s=120):
        assert backend == "nccl"
        for who, text in zip(("DistributedDataParallel", "ZeroDataParallel"), said, strict=True):
            assert text is not None and text.startswith(
                f"{who}: weight (and 1 more) is on cpu, but the process group's backend 'nccl' "
                "moves only cuda tensors"), text


def test_the_cuda_generator_state_is_in_snapshots_and_restored():
    torch.ones(1, device="cuda")  # CUDA in use: its generators belong in the state
    state = get_rng_state()
    assert len(state["cuda"]) == cuda_device_count()
    first = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def _pinned(rank: int, world_size: int) -> tuple[bool, bool]:
    """The trainer on CUDA hands the strategy page-locked batches (a copy the host does not
    wait for); its micro-batches on the CPU are not pinned (no CUDA call on a CPU path)."""
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    rt = get_runtime()
    trainer = Trainer(make_strategy("ddp", runtime=rt), rt, lambda: GPT(MODEL),
                      AdditionDataset("train", 1), None, loss_fn,
                      TrainerConfig(steps=1, batch_size=4, progress=False))
    x, y = trainer.batches.next()
    return x.is_pinned(), y.is_pinned()


def test_the_trainer_pins_its_batches_on_cuda():
    assert run_workers(_pinned, 1, device="cuda", timeout_s=120) == [(True, True)]


def test_sampling_a_cuda_model_with_the_usual_cpu_generator():
    """Used to raise "Expected a 'cuda' device type for generator but found 'cpu'" at the end of
    `ringtrain train --data` on CUDA (ringtrain.data.tokens.sample_tokens)."""
    torch.manual_seed(0)
    model = GPT(MODEL).cuda().eval()
    start = torch.zeros(1, 1, dtype=torch.long)
    on_gpu = model.generate(start, 12, generator=torch.Generator().manual_seed(3))
    assert on_gpu.shape == (1, 13) and on_gpu.is_cuda
    greedy = model.generate(start, 12, temperature=0)
    assert torch.equal(greedy.cpu(), model.cpu().generate(start, 12, temperature=0))


def _train(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "ringtrain", "train", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("strategy, data_ranks", [
    ([], 2), (["--strategy", "zero", "--zero-stage", "3"], 2),
    (["--strategy", "pipeline", "--pp", "2"], 1)], ids=["ddp", "zero3", "pipeline"])
def test_ringtrain_train_two_ranks_on_one_gpu_equal_one_process(tmp_path, strategy, data_ranks):
    """The same global batch on one process and on two ranks sharing the GPU over gloo."""
    one = _train([*TINY, "--batch-size", str(16 * data_ranks), "--device", "cuda",
                  "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _train([*TINY, *strategy, "--nproc-per-node", "2", "--backend", "gloo", "--device",
                  "cuda", "--run-dir", str(tmp_path / "two")], tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert (config["args"]["backend"], config["args"]["device"]) == ("gloo", "cuda")
    got, want = _summary(tmp_path / "two"), _summary(tmp_path / "one")
    for key in ("train_loss", "eval_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key


def test_ringtrain_train_on_text_samples_and_exports_on_cuda(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    proc = _train(["--data", str(text), "--block-size", "16", "--steps", "4", "--n-layer", "1",
                   "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--dtype", "bf16",
                   "--no-progress", "--sample-length", "20", "--run-dir", str(tmp_path / "run")],
                  tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert "cuda" in proc.stderr + proc.stdout  # rank 0 names its device when it starts


def test_more_nccl_processes_than_gpus_is_refused_before_any_worker_starts(tmp_path):
    n = cuda_device_count() + 1
    proc = _train([*TINY, "--nproc-per-node", str(n), "--run-dir", str(tmp_path / "r")], tmp_path)
    assert proc.returncode == 2
    assert f"{n} processes on this machine but {n - 1} GPU" in proc.stderr
    assert "Duplicate GPU" not in proc.stderr.replace("'Duplicate GPU detected'", "")


def _bf16_ran(rank: int, world_size: int) -> list[torch.dtype]:
    """The trainer's bf16 autocast reaches the model on CUDA: a hook sees bf16 activations."""
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    seen: list[torch.dtype] = []

    def model_fn():
        model = GPT(GPTConfig(vocab_size=16, block_size=7, n_layer=1, n_head=2, n_embd=16))
        model.head.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        return model

    rt = get_runtime()
    trainer = Trainer(make_strategy("ddp", runtime=rt), rt, model_fn, AdditionDataset("train", 1),
                      None, loss_fn, TrainerConfig(steps=2, batch_size=8, dtype="bf16",
                                                   progress=False))
    trainer.fit()
    return seen


def test_bf16_autocast_runs_on_cuda():
    seen = run_workers(_bf16_ran, 1, device="cuda", timeout_s=120)[0]
    assert seen and set(seen) == {torch.bfloat16}


def test_a_worker_forked_from_the_warm_process_uses_cuda():
    """A CUDA build's `import torch` loads the driver's library without initialising it: the
    warm process must fork then (session 22 found every fork refused on an H100), and the fork's
    CUDA must work (a raw fork did on an H200). The same check as benchmarks/forked_cuda.py."""
    run = subprocess.run([sys.executable, "benchmarks/forked_cuda.py", "cuda"],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "forked: True" in run.stdout, run.stdout + run.stderr
    assert "sum 1000.0" in run.stdout, run.stdout
