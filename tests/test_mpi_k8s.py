"""MPI and Kubernetes, by their variables: two processes started with the environment `mpirun` or
the PyTorchJob operator would give them run examples/ddp_train.py to the same final weights as
`ringtrain run --nproc-per-node 2`.

    .venv/bin/pytest -q tests/test_mpi_k8s.py

Neither mpirun nor a Kubernetes cluster is needed: the variables are set by hand, as each
launcher documents them (the reading of every variable is unit-tested in test_environments.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from same_weights import reference_digest, run_with_envs  # noqa: E402

from ringtrain.launch.network import reserve_port  # noqa: E402


def test_open_mpi_variables(request, tmp_path):
    with reserve_port() as port:  # held while the ranks start (ringtrain.launch.network)
        envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                 "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                 "MASTER_PORT": str(port)} for r in range(2)]  # as `mpirun -x MASTER_PORT=..`
        digest, outputs = run_with_envs(envs, tmp_path)
    assert (f"ringtrain: mpi: rank 0 of world_size 2 (local_rank 0), master 127.0.0.1:{port}"
            in outputs[0])
    assert digest == reference_digest(request.config, tmp_path)


def test_kubernetes_pytorchjob_variables(request, tmp_path):
    with reserve_port() as port:
        envs = [{"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": str(r), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
        digest, outputs = run_with_envs(envs, tmp_path)  # one pod each
    assert "ringtrain: kubernetes: rank 0 of world_size 2 (local_rank 0)" in outputs[0]
    assert digest == reference_digest(request.config, tmp_path)
