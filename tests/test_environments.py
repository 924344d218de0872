"""Which launcher started a process, from its environment alone
(`ringtrain.launch.environments`)."""

import logging

import pytest
import torch
import torch.distributed as dist

from ringtrain.launch.environments import (
    SINGLE,
    Environment,
    detect,
    existing_group_name,
    expand_nodelist,
    from_arguments,
)
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.runtime import DistributedInitError, get_runtime

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
         "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[07-08]"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "29501"}
PYTORCHJOB = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": "1", "WORLD_SIZE": "2",
              "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
TRAINER_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}


def test_nothing_set_is_one_process():
    assert detect({}) == SINGLE
    assert detect({"PATH": "/bin", "SLURM_JOB_ID": "5"}) == SINGLE  # an salloc shell: no task


@pytest.mark.parametrize("extra,name", [({}, "torchrun"),
                                        ({"RINGTRAIN_LAUNCHER_PID": "12"}, "ringtrain run"),
                                        ({"TORCHX_RANK0_HOST": "localhost"}, "torchx")])
def test_torchrun_family(extra, name):
    assert detect({**TORCHRUN, **extra}) == Environment(name, 3, 4, 1, "10.0.0.1", 29500)


def test_torchrun_wins_over_the_slurm_task_that_started_it():
    # `srun --ntasks-per-node=1 ringtrain run ...`: SLURM_PROCID is the launcher's, not the
    # worker's.
    assert detect({**SLURM, **TORCHRUN}).name == "torchrun"


def test_torchrun_missing_variables_listed_together():
    env = {k: v for k, v in TORCHRUN.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(DistributedInitError,
                       match=r"under torchrun: MASTER_ADDR, MASTER_PORT not set"):
        detect(env)


def test_by_hand_missing_variables_and_the_command_that_sets_them():
    with pytest.raises(DistributedInitError) as e:
        detect({"WORLD_SIZE": "2"})
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "ringtrain run --nproc-per-node"):
        assert name in str(e.value)
    assert detect({"WORLD_SIZE": "1"}).world_size == 1


@pytest.mark.parametrize("env,match", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"Invalid rank 2, .*\[0, 1\]"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size=0"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
     r"MASTER_PORT=70000 is outside 1..65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),
])
def test_by_hand_bad_values(env, match):
    with pytest.raises(DistributedInitError, match=match):
        detect({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env})


def test_kubernetes_pytorchjob_one_process_per_pod():
    assert detect(PYTORCHJOB) == Environment("kubernetes", 1, 2, 0, "job-master-0", 23456)
    broken = {k: v for k, v in PYTORCHJOB.items() if k != "MASTER_PORT"}
    with pytest.raises(DistributedInitError, match="MASTER_PORT not set.*PyTorchJob operator"):
        detect(broken)


def test_kubeflow_trainer_v2():
    assert detect(TRAINER_V2) == Environment("kubernetes", 1, 2, 0, "job-node-0-0.job", 29400)
    with pytest.raises(DistributedInitError, match="PET_NPROC_PER_NODE=4.*ringtrain run script.py"):
        detect({**TRAINER_V2, "PET_NPROC_PER_NODE": "4"})
    with pytest.raises(DistributedInitError, match="PET_MASTER_ADDR, PET_MASTER_PORT not set"):
        detect({"PET_NNODES": "2", "PET_NODE_RANK": "0"})


def test_slurm_master_from_the_node_list_and_port_from_the_job():
    assert detect(SLURM) == Environment("slurm", 1, 2, 1, "node07", 20000 + 3456)
    step = detect({**SLURM, "SLURM_STEP_NODELIST": "gpu[3,5]"})  # the step's nodes come first
    assert step.master_addr == "gpu3"
    mine = detect({**SLURM, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"})
    assert (mine.master_addr, mine.master_port) == ("10.1.1.1", 4000)


def test_slurm_batch_script_itself_is_refused():
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    with pytest.raises(DistributedInitError, match=r"batch script itself.*srun python script.py"):
        detect(batch)
    assert detect({**batch, "SLURM_NTASKS": "1"}) == Environment("slurm", 0, 1, 0, None, None)


@pytest.mark.parametrize("env,match", [
    ({"SLURM_NTASKS": None}, "SLURM_NTASKS not set.*srun"),
    ({"SLURM_PROCID": "5"}, r"Invalid rank 5.*\(slurm\)"),
    ({"SLURM_JOB_NODELIST": "node[01-"},
     "SLURM_JOB_NODELIST: node list 'node\\[01-'.*never closed"),
    ({"SLURM_JOB_NODELIST": None}, "no node list.*MASTER_ADDR"),
    ({"SLURM_JOB_ID": None}, "no MASTER_PORT and no SLURM_JOB_ID"),
])
def test_slurm_broken(env, match):
    broken = {**SLURM, **env}
    with pytest.raises(DistributedInitError, match=match):
        detect({k: v for k, v in broken.items() if v is not None})


def test_contradicting_launchers_are_named_together():
    with pytest.raises(DistributedInitError, match=r"RANK=0 WORLD_SIZE=2 disagree with slurm's "
                       r"SLURM_PROCID=1 SLURM_NTASKS=2: unset RANK and WORLD_SIZE"):
        detect({**SLURM, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    agreeing = detect(
        {**SLURM, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    )
    assert (agreeing.rank, agreeing.world_size) == (1, 2)


def test_mpi_open_mpi_and_mpich():
    assert detect(OMPI) == Environment("mpi", 1, 2, 1, "127.0.0.1", 29501)  # all ranks on this node
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "h0",
             "MASTER_PORT": "29502"}
    assert detect(mpich) == Environment("mpi", 2, 4, 0, "h0", 29502)


def test_mpi_needs_the_master_passed_by_mpirun():
    with pytest.raises(DistributedInitError, match=r"MASTER_PORT not set.*mpirun -x MASTER_ADDR"):
        detect({k: v for k, v in OMPI.items() if k != "MASTER_PORT"})
    across = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}  # ranks on several nodes
    with pytest.raises(DistributedInitError, match=r"MASTER_ADDR not set"):
        detect(across)
    with pytest.raises(DistributedInitError, match=r"PMI_SIZE not set"):
        detect({"PMI_RANK": "0"})


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b[8-10],c", ["a", "b8", "b9", "b10", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("vm", ["vm"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,match", [("n[3-1]", "backwards"), ("n[a-b]", "not a number"),
                                            ("n]", "nest"), ("", "names no host")])
def test_expand_nodelist_malformed(nodelist, match):
    with pytest.raises(ValueError, match=match):
        expand_nodelist(nodelist)


def test_arguments_win_and_torchrun_variables_fill_in():
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "29500", **SLURM}
    e = from_arguments(env, rank=1, world_size=2, master_addr=None, master_port=None)
    assert e == Environment("arguments", 1, 2, 1, "h", 29500)
    with pytest.raises(DistributedInitError, match="MASTER_ADDR, MASTER_PORT not set"):
        from_arguments({}, 0, 2, None, None)


def test_existing_group_names_ray():
    assert existing_group_name({"RAY_NODE_ID": "x"}) == "ray train"
    assert existing_group_name({}) == "an existing process group"


@pytest.fixture
def clean_env(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID", "ACCELERATE_TORCH_DEVICE"):
        monkeypatch.delenv(v, raising=False)
    yield monkeypatch
    destroy_distributed()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_logs_what_it_found_once(clean_env, caplog):
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        init_distributed()
        init_distributed()
    found = [r.getMessage() for r in caplog.records if "world_size" in r.getMessage()]
    assert found == ["ringtrain: single process: rank 0 of world_size 1 (local_rank 0), "
                     "no master (one process), device cpu"]
    from ringtrain.launch.process_group import _log_found  # under `ringtrain run`: said once

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        _log_found("ringtrain run", get_runtime(), "localhost", 29500)
    assert [r.getMessage() for r in caplog.records] == [
        "ringtrain run: rank 0 of world_size 1 (local_rank 0), master localhost:29500, device cpu"]


def test_a_group_started_elsewhere_is_adopted_and_left_alone(clean_env):
    # As Ray Train does: the group is up before the training function calls init_distributed.
    clean_env.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    clean_env.setenv("RAY_NODE_ID", "x")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rt = init_distributed()
    assert (rt.rank, rt.world_size, rt.device) == (0, 1, torch.device("cpu"))
    assert get_runtime() is rt
    destroy_distributed()
    assert dist.is_initialized()  # Ray destroys its own group
