"""Where rank, world size and the master come from: one reader per launcher, `detect` picks one.

    >>> from ringtrain.launch.environments import detect
    >>> detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
    ...         "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
    ...         "SLURM_JOB_ID": "42"})  # doctest: +NORMALIZE_WHITESPACE
    Environment(name='slurm', rank=1, world_size=2, local_rank=1, master_addr='node01',
                master_port=20042)

Pure functions of an environment mapping, so every launcher is tested without starting one
(tests/test_environments.py). `ringtrain.init_distributed()` calls `detect(os.environ)`. The
order, first match wins:

1. torchrun's agent (`ringtrain run`, `torchrun`, TorchX's `dist.ddp`, Kubeflow Trainer's
   torchrun): TORCHELASTIC_RUN_ID is set; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
2. RANK / WORLD_SIZE set by hand or by the Kubernetes PyTorchJob operator (one process per pod),
   with MASTER_ADDR and MASTER_PORT. Where a scheduler's variables are set too they must agree.
3. Kubeflow Trainer v2 without torchrun: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
   PET_MASTER_PORT, with PET_NPROC_PER_NODE=1 (more processes per pod need `ringtrain run`).
4. Slurm, one task per process (`srun`): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master
   is MASTER_ADDR or the first node of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, the port
   MASTER_PORT or 20000 + the last four digits of SLURM_JOB_ID.
5. MPI (`mpirun`): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (Open MPI) or PMI_RANK / PMI_SIZE
   (MPICH, Intel MPI); MASTER_PORT from `mpirun -x MASTER_PORT=...`, MASTER_ADDR likewise
   (127.0.0.1 when every rank is on this node).
6. Nothing: one process.

Ray Train starts the process group itself; `init_distributed` reuses it (`existing_group_name`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ringtrain.runtime import DistributedInitError

LAUNCHER_PID_ENV = "RINGTRAIN_LAUNCHER_PID"  # set by `ringtrain run` for its workers
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
SLURM_PORT_BASE = 20000  # + the job id's last four digits: below Linux's ephemeral ports

_HOW_TORCHRUN = ("Launch with `ringtrain run --nproc-per-node N script.py` (it sets all four), or "
                 "export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=N RANK=i for each "
                 "process.")
_HOW_SLURM = ("srun sets them for each task: start one task per process with `srun python "
              "script.py`, or one `ringtrain run` per node with `srun --ntasks-per-node=1`")
_HOW_MPI = ("mpirun sets the rank and size; pass the master with `mpirun -x MASTER_ADDR=<host of "
            "rank 0> -x MASTER_PORT=29500 ...`")
_HOW_PET = ("Kubeflow Trainer sets them in each pod (spec.trainer.numNodes, numProcPerNode); "
            "check the TrainJob")


@dataclass(frozen=True)
class Environment:
    """What a launcher told this process.

    Args:
        name: the launcher ("torchrun", "ringtrain run", "torchx", "kubernetes", "slurm",
            "mpi", "environment variables", "arguments", "single process").
        rank, world_size, local_rank: torch.distributed's words.
        master_addr, master_port: where rank 0's store listens; None for a single process.
    """

    name: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


SINGLE = Environment("single process", 0, 1, 0, None, None)


def _int(env: Mapping[str, str], name: str, how: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedInitError(f"{name}={value!r} is not an integer; {how}") from None


def _missing(name: str, env: Mapping[str, str], needed: tuple[str, ...], how: str) -> None:
    """Raise listing every variable of `needed` not in `env` (all at once), with the fix."""
    missing = [v for v in needed if v not in env]
    if missing:
        have = ", ".join(f"{v}={env[v]}" for v in needed if v in env) or "nothing"
        raise DistributedInitError(
            f"cannot start the process group under {name}: {', '.join(missing)} not set "
            f"(have {have}). {how}")


def _port(name: str, value: object) -> int:
    try:
        port = int(str(value))
    except ValueError:
        raise DistributedInitError(f"{name}={value!r} is not a port number") from None
    if not 0 < port < 65536:
        raise DistributedInitError(f"{name}={port} is outside 1..65535")
    return port


def _checked(e: Environment) -> Environment:
    """The checks every launcher's values go through; one process needs no master."""
    if e.world_size < 1:
        raise DistributedInitError(f"world_size={e.world_size}: it must be at least 1 ({e.name})")
    if not 0 <= e.rank < e.world_size:
        raise DistributedInitError(
            f"Invalid rank {e.rank}, rank should be in the interval [0, {e.world_size - 1}] "
            f"for world_size={e.world_size} ({e.name})")
    if e.world_size == 1:
        return Environment(e.name, 0, 1, 0, None, None)
    return e


# ---- Slurm's node lists ---------------------------------------------------------------------

def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"node list {text!r}: brackets do not nest in a Slurm node list")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {text!r}: a '[' is never closed")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"], keeping the zero padding of the lower bound."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise ValueError(f"node list {nodelist!r}: {item!r} is not a number or a range N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"node list {nodelist!r}: range {item!r} runs backwards")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, expanded in order (as `scontrol show hostnames` does).

        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
        >>> expand_nodelist("rack[1-2]-n[1-2]")
        ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']

    Raises ValueError naming the list where it is malformed.
    """
    hosts: list[str] = []
    for part in _split_top(nodelist.strip()):
        names = [""]
        for text, bracket in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            names = [n + text for n in names]
            if bracket:
                names = [n + x for n in names for x in _expand_range(bracket, nodelist)]
        hosts += names
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no host")
    return hosts


# ---- one reader per launcher ------------------------------------------------------------------

def _torchrun(env: Mapping[str, str]) -> Environment:
    if env.get(LAUNCHER_PID_ENV):
        name = "ringtrain run"
    elif any(k.startswith("TORCHX_") for k in env):
        name = "torchx"
    else:
        name = "torchrun"
    how = f"{name} sets all of them for every worker; was the variable overwritten?"
    _missing(name, env, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), how)
    rank = _int(env, "RANK", how)
    return Environment(name, rank, _int(env, "WORLD_SIZE", how),
                       _int(env, "LOCAL_RANK", how) if "LOCAL_RANK" in env else rank,
                       env["MASTER_ADDR"], _port("MASTER_PORT", env["MASTER_PORT"]))


def _scheduler_rank(env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(name, rank variable, size variable) of a scheduler whose variables are set, if any."""
    for name, rank, size in (("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
                             ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                             ("mpi", "PMI_RANK", "PMI_SIZE")):
        if rank in env and size in env and (name != "slurm" or "SLURM_STEP_ID" in env):
            return name, rank, size
    return None


def _by_hand(env: Mapping[str, str]) -> Environment:
    """RANK / WORLD_SIZE without an agent: exported by hand, or by the PyTorchJob operator."""
    name = "kubernetes" if "KUBERNETES_SERVICE_HOST" in env else "environment variables"
    how = ("The PyTorchJob operator sets all four in every replica; check the job's spec."
           if name == "kubernetes" else _HOW_TORCHRUN)
    if not ("WORLD_SIZE" in env and env["WORLD_SIZE"] == "1" and env.get("RANK", "0") == "0"):
        _missing(name, env, TORCHRUN_VARS, how)
    rank, world = _int(env, "RANK", how) if "RANK" in env else 0, _int(env, "WORLD_SIZE", how)
    other = _scheduler_rank(env)
    if other is not None:
        sched, rank_var, size_var = other
        how_theirs = _HOW_SLURM if sched == "slurm" else _HOW_MPI
        theirs = (_int(env, rank_var, how_theirs), _int(env, size_var, how_theirs))
        if theirs != (rank, world):
            raise DistributedInitError(
                f"RANK={rank} WORLD_SIZE={world} disagree with {sched}'s {rank_var}={theirs[0]} "
                f"{size_var}={theirs[1]}: unset RANK and WORLD_SIZE to use {sched}'s (ringtrain "
                f"reads them), or start the processes without {sched}")
    if world == 1:
        return Environment(name, rank, 1, 0, None, None)
    local = (_int(env, "LOCAL_RANK", how) if "LOCAL_RANK" in env
             else (0 if name == "kubernetes" else rank))
    return Environment(name, rank, world, local, env["MASTER_ADDR"],
                       _port("MASTER_PORT", env["MASTER_PORT"]))


def _kubeflow_trainer(env: Mapping[str, str]) -> Environment:
    """Kubeflow Trainer v2's PET_ variables (torchrun's own flags), read without torchrun."""
    name = "kubernetes"
    _missing(name, env, ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
             _HOW_PET)
    per_node = env.get("PET_NPROC_PER_NODE", "1")
    if per_node != "1":
        raise DistributedInitError(
            f"PET_NPROC_PER_NODE={per_node}: this pod should run {per_node} processes, but the "
            "script was started alone; start it with `ringtrain run script.py` (or torchrun), "
            "which reads the PET_ variables and starts them")
    return Environment(name, _int(env, "PET_NODE_RANK", _HOW_PET),
                       _int(env, "PET_NNODES", _HOW_PET), 0, env["PET_MASTER_ADDR"],
                       _port("PET_MASTER_PORT", env["PET_MASTER_PORT"]))


def _slurm(env: Mapping[str, str]) -> Environment:
    if "SLURM_STEP_ID" not in env and env.get("SLURM_NTASKS", "1") != "1":
        raise DistributedInitError(
            f"SLURM_PROCID={env['SLURM_PROCID']} SLURM_NTASKS={env['SLURM_NTASKS']} but no "
            "SLURM_STEP_ID: this is the batch script itself, not a task srun started, and the "
            f"other {env['SLURM_NTASKS']} tasks would never come; {_HOW_SLURM}")
    _missing("slurm", env, ("SLURM_PROCID", "SLURM_NTASKS"), _HOW_SLURM)
    rank, world = _int(env, "SLURM_PROCID", _HOW_SLURM), _int(env, "SLURM_NTASKS", _HOW_SLURM)
    local = _int(env, "SLURM_LOCALID", _HOW_SLURM) if "SLURM_LOCALID" in env else 0
    if world == 1:
        return Environment("slurm", rank, world, local, None, None)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        lists = [v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                 if v in env]
        if not lists:
            raise DistributedInitError(
                "cannot start the process group under slurm: no MASTER_ADDR and no node list "
                "(SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) to take the first node from; "
                f"export MASTER_ADDR=<host of task 0>, or {_HOW_SLURM}")
        try:
            addr = expand_nodelist(env[lists[0]])[0]
        except ValueError as e:
            raise DistributedInitError(
                f"{lists[0]}: {e}; export MASTER_ADDR=<host of task 0>") from None
    if "MASTER_PORT" in env:
        port = _port("MASTER_PORT", env["MASTER_PORT"])
    elif "SLURM_JOB_ID" in env:
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", _HOW_SLURM) % 10000
    else:
        raise DistributedInitError("cannot start the process group under slurm: no MASTER_PORT and "
                                   "no SLURM_JOB_ID to derive one from; export MASTER_PORT=29500")
    return Environment("slurm", rank, world, local, addr, port)


def _mpi(env: Mapping[str, str], rank_var: str, size_var: str) -> Environment:
    rank, world = _int(env, rank_var, _HOW_MPI), _int(env, size_var, _HOW_MPI)
    local_var = next((v for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
                      if v in env), None)
    local = _int(env, local_var, _HOW_MPI) if local_var else 0
    if world == 1:
        return Environment("mpi", rank, world, local, None, None)
    all_here = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("MPI_LOCALNRANKS")) == str(world)
    needed = ("MASTER_PORT",) if all_here else ("MASTER_ADDR", "MASTER_PORT")
    _missing("mpi", env, needed, _HOW_MPI)
    return Environment("mpi", rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"),
                       _port("MASTER_PORT", env["MASTER_PORT"]))


def detect(env: Mapping[str, str]) -> Environment:
    """The launcher that started this process and what it says, checked.

    Args:
        env: the environment to read (`os.environ` in `init_distributed`).

    Raises `DistributedInitError` listing every missing variable together with what would set
    it, naming contradicting variables, or for an impossible rank or world size.
    """
    if "TORCHELASTIC_RUN_ID" in env:
        return _checked(_torchrun(env))
    if "RANK" in env or "WORLD_SIZE" in env:
        return _checked(_by_hand(env))
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return _checked(_kubeflow_trainer(env))
    if "SLURM_PROCID" in env:
        return _checked(_slurm(env))
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        if rank_var in env:
            _missing("mpi", env, (rank_var, size_var), _HOW_MPI)
            return _checked(_mpi(env, rank_var, size_var))
    return SINGLE


def from_arguments(env: Mapping[str, str], rank: int | None, world_size: int | None,
                   master_addr: str | None, master_port: int | None) -> Environment:
    """`init_distributed(rank=..., ...)`: each argument given wins, torchrun's variables fill the
    rest."""
    given: dict[str, object] = {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": master_addr,
                                "MASTER_PORT": master_port}
    for name in TORCHRUN_VARS:
        if given[name] is None and name in env:
            given[name] = (_int(env, name, _HOW_TORCHRUN) if name in ("RANK", "WORLD_SIZE")
                           else env[name])
    if given["WORLD_SIZE"] == 1 and given["RANK"] in (None, 0):
        return Environment("arguments", 0, 1, 0, None, None)
    _missing("arguments", {k: str(v) for k, v in given.items() if v is not None}, TORCHRUN_VARS,
             _HOW_TORCHRUN)
    r, w = int(given["RANK"]), int(given["WORLD_SIZE"])  # type: ignore[call-overload]
    local = _int(env, "LOCAL_RANK", _HOW_TORCHRUN) if "LOCAL_RANK" in env else r
    return _checked(Environment("arguments", r, w, local, str(given["MASTER_ADDR"]),
                                _port("MASTER_PORT", given["MASTER_PORT"])))


def existing_group_name(env: Mapping[str, str]) -> str:
    """Who started the process group this process found already running (Ray Train, or the
    script)."""

    if any(k.startswith("RAY_") for k in env) or "ACCELERATE_TORCH_DEVICE" in env:
        return "ray train"
    return "an existing process group"
