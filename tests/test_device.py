"""The backend and device rule (ringtrain.launch.device), and `ringtrain train`'s check of it
before any worker starts. Pure: the GPU count is handed in (or torch's is patched), so these run
on a CPU box; tests/test_cuda.py runs the same rule on a real GPU.

    .venv/bin/pytest -q tests/test_device.py
"""

from __future__ import annotations

import os

import pytest
import torch

from ringtrain.launch.device import DEVICE_ENV, Placement, PlacementError, choose


def _never() -> int:
    raise AssertionError("the GPU count was asked for on a CPU path")


def _gpus(n: int):
    return lambda: n


@pytest.mark.parametrize("backend, device, gpus, local_rank, want", [
    (None, None, 0, 0, ("gloo", "cpu")),          # a CPU box
    (None, None, 2, 1, ("nccl", "cuda:1")),       # one GPU per local rank
    ("gloo", None, 2, 1, ("gloo", "cpu")),        # gloo alone means the CPU
    ("gloo", "cuda", 1, 1, ("gloo", "cuda:0")),   # ranks share a GPU over gloo
    (None, "cuda", 1, 0, ("nccl", "cuda:0")),
    ("auto", "auto", 1, 0, ("nccl", "cuda:0")),
])
def test_the_rule(backend, device, gpus, local_rank, want):
    got = choose(backend, device, local_rank=local_rank, local_world_size=2 if gpus > 1 else 1,
                 env={}, gpus=_gpus(gpus))
    assert got == Placement(want[0], torch.device(want[1]))


def test_the_cpu_asked_for_never_asks_for_gpus():
    assert choose(None, "cpu", env={}, gpus=_never).device == torch.device("cpu")
    assert choose("gloo", None, env={}, gpus=_never).device == torch.device("cpu")
    assert choose(None, None, env={DEVICE_ENV: "cpu"}, gpus=_never).backend == "gloo"


def test_an_argument_wins_over_the_environment_which_wins_over_auto():
    env = {DEVICE_ENV: "cpu", "RINGTRAIN_BACKEND": "gloo"}
    assert choose(None, None, env=env, gpus=_gpus(1)) == Placement("gloo", torch.device("cpu"))
    assert (choose(None, "cuda", env=env, gpus=_gpus(1))
            == Placement("gloo", torch.device("cuda", 0)))
    # `auto` is the CLI's default, not a choice: RINGTRAIN_DEVICE=cpu still wins on a GPU box
    # (the suite's CPU tests launched `ringtrain train --nproc-per-node 2` with NCCL there)
    assert (choose("auto", "auto", env={DEVICE_ENV: "cpu"}, local_world_size=3, gpus=_never)
            == Placement("gloo", torch.device("cpu")))


def test_more_nccl_processes_than_gpus_is_one_clear_error():
    with pytest.raises(PlacementError) as e:
        choose(None, None, local_rank=1, local_world_size=2, env={}, gpus=_gpus(1))
    text = str(e.value)
    assert "2 processes on this machine but 1 GPU" in text
    assert "--nproc-per-node 1" in text and "--backend gloo --device cuda" in text
    assert "--device cpu" in text and isinstance(e.value, ValueError)


@pytest.mark.parametrize("backend, device, env, gpus, says", [
    ("nccl", "cpu", {}, 1, "backend nccl needs CUDA tensors"),
    (None, "cuda", {}, 0, "device cuda was asked for but torch"),
    ("nccl", None, {}, 0, "backend nccl was asked for but torch"),  # not the --device cpu fix
    (None, None, {DEVICE_ENV: "gpu"}, 1, "RINGTRAIN_DEVICE='gpu': use one of auto, cpu, cuda"),
    ("foo", None, {}, 1, "backend='foo': use one of auto, gloo, nccl"),  # init_distributed's
])
def test_what_this_machine_cannot_give_is_named(backend, device, env, gpus, says):
    with pytest.raises(PlacementError, match=says.replace("(", r"\(")):
        choose(backend, device, env=env, gpus=_gpus(gpus))


@pytest.mark.parametrize("backend, device, fix", [
    (None, "cuda", "use --device cpu (RINGTRAIN_DEVICE=cpu)"),
    ("nccl", None, "use --backend gloo (RINGTRAIN_BACKEND=gloo) for the CPU")])
def test_no_gpu_names_what_was_asked_its_fix_and_a_cpu_only_build(monkeypatch, backend, device,
                                                                  fix):
    """`--device cuda` on a CPU-only torch said "backend nccl was asked for" (the backend it
    implied), and named no cause: the build, where it is a CPU-only one."""
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(PlacementError) as e:
        choose(backend, device, env={}, gpus=_gpus(0))
    asked = "device cuda" if device else "backend nccl"
    assert str(e.value).startswith(f"{asked} was asked for but torch {torch.__version__} (a "
                                   "CPU-only build: GPUs need a CUDA build of torch) sees no GPU "
                                   f"here: {fix}, or check CUDA_VISIBLE_DEVICES")


def test_ringtrain_train_refuses_two_nccl_ranks_on_one_gpu_before_any_worker_starts(
        monkeypatch, capsys, clean_env):
    """On a 1-GPU box `ringtrain train --nproc-per-node 2` used to start both workers, which
    failed in NCCL with 'Duplicate GPU detected : rank 0 and rank 1 both on CUDA device'."""
    from ringtrain.cli.train import main

    monkeypatch.delenv(DEVICE_ENV)  # what a user's GPU box has: nothing set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def launched(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("ringtrain.launch.launcher.launch", launched)
    assert main(["--nproc-per-node", "2", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ringtrain train: error: 2 processes on this machine but 1 GPU" in err
    assert "--nproc-per-node 1" in err and "--backend gloo --device cuda" in err



def test_the_launchers_check_counts_gpus_without_is_available(monkeypatch, clean_env):
    """`is_available` may initialise the CUDA driver (cuInit), after which the launcher's fork,
    the workers' warm process, could not use CUDA: the launcher counts as device_count does."""
    from ringtrain.cli.train_args import check_args, parse_options

    monkeypatch.delenv(DEVICE_ENV)

    def initialises() -> bool:
        raise AssertionError("the launcher called torch.cuda.is_available")

    monkeypatch.setattr(torch.cuda, "is_available", initialises)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PlacementError, match="2 processes on this machine but 1 GPU"):
        check_args(parse_options(["--nproc-per-node", "2"]))


def test_torchs_launch_config_counts_gpus_without_initialising_cuda(monkeypatch, clean_env,
                                                                     tmp_path):
    """torch's `config_from_args` asks `is_available()` for its NUMA default, which calls
    cuInit by default: then the launcher's fork, the job's warm process, could not use CUDA,
    and on an H200 every `ringtrain train` job's workers started cold, --device cpu too
    (session 39). The launcher has torch count through NVML there; the variable saying so is
    gone once the config is made (the workers get the user's environment)."""
    from ringtrain.launch import launcher
    from ringtrain.launch.device import NVML_CHECK_ENV

    monkeypatch.delenv(NVML_CHECK_ENV, raising=False)
    runtime_counts = []  # cudaGetDeviceCount: what initialises the driver

    def runtime_count() -> int:
        runtime_counts.append(1)
        return 1

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)  # a CUDA build with 1 GPU
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", runtime_count, raising=False)
    made = {}

    class Configured(Exception):
        pass

    def starts(**kwargs):
        made["env"] = dict(os.environ)
        raise Configured

    monkeypatch.setattr(launcher, "forked_worker_starts", starts)
    script = tmp_path / "train.py"
    script.write_text("")
    launcher.launch(str(script), [], nproc_per_node=1)  # stopped where the zygote is forked
    assert "env" in made and runtime_counts == []
    assert NVML_CHECK_ENV not in made["env"] and NVML_CHECK_ENV not in os.environ


def test_ringtrain_train_on_a_gpu_box_with_the_cpu_in_the_environment_launches(
        monkeypatch, clean_env, tmp_path):
    """RINGTRAIN_DEVICE=cpu (what the test suite sets) on a 1-GPU box: `ringtrain train
    --nproc-per-node 2` launches on gloo; the CLI's default `--device auto` used to hide the
    variable, and every CPU test that launched 2 workers was refused on an H100 box."""
    from ringtrain.cli.train import main

    monkeypatch.setenv(DEVICE_ENV, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class Launched(Exception):
        pass

    def launched(*args, **kwargs):
        raise Launched

    monkeypatch.setattr("ringtrain.launch.launcher.launch", launched)
    with pytest.raises(Launched):
        main(["--nproc-per-node", "2", "--steps", "2", "--no-progress",
              "--run-dir", str(tmp_path / "run")])

@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_ringtrain_train_with_the_cpu_asked_for_starts_on_a_gpu_box(
    monkeypatch, clean_env, tmp_path
):
    """--device cpu on a box that has GPUs: gloo, CPU tensors, no GPU count needed."""
    from ringtrain.cli.train import main

    monkeypatch.setattr(torch.cuda, "device_count", _never)
    assert main(["--device", "cpu", "--steps", "2", "--no-progress", "--n-layer", "1",
                 "--n-embd", "16", "--n-head", "2", "--batch-size", "8",
                 "--run-dir", str(tmp_path / "run")]) == 0
