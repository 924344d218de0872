"""The command line of `ringtrain train`: its parser, and what the parsed options become.

    ringtrain train --help

`build_parser` and `check_args` (the errors the parser cannot see) say what is allowed; the rest
turns the options into what the job needs: the relaunched workers' argv (`worker_argv`), the
trainer's settings (`trainer_config`), the chosen strategy's options (`strategy_options`), the
options a snapshot must match (`run_config`) and the ranks the job may lose (`tolerated_ranks`).
The job itself (`run_job`, `main`) is in `ringtrain.cli.train`. The data and trainer modules are
imported inside the functions that use them, so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ringtrain.launch.device import BACKENDS, DEVICES, choose
from ringtrain.strategies import Strategy, registered
from ringtrain.strategies.base import int_at_least, non_negative_float
from ringtrain.trace import parse_steps

# Flags that belong to the launcher: the relaunched workers do not see them.
LAUNCHER_FLAGS = ("nproc_per_node", "max_restarts", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id",
                  "shutdown_timeout", "memory_limit")
# Each strategy's own flags are declared by the strategy (`Strategy.options`): only the chosen
# strategy's flags are passed to make_strategy, and only those the user set (its defaults apply).
# Defaults that depend on the task; --help shows them as "addition / text". The addition
# default reaches 100 % held-out accuracy by step ~700 of 1000 on 2 processes (seeds 1-3, 1337).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "addition": {"n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0, "steps": 1000,
                 "batch_size": 64, "lr": 3e-3, "snapshot_every": 100},
    # nanoGPT's CPU recipe for Shakespeare characters (block 64, batch 12, 4 x 128, 2000 steps).
    "text": {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, "steps": 2000,
             "batch_size": 12, "lr": 1e-3, "snapshot_every": 200},
}


_positive_int, _non_negative_int = int_at_least(1), int_at_least(0)


def _memory_size(text: str) -> str:
    from ringtrain.launch.cgroup import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
_NEGATABLE = ("bias",)  # --flag/--no-flag options: False is passed on as --no-flag


def _task_default(key: str) -> str:
    return f"default: {TASK_DEFAULTS['addition'][key]} (addition) / {TASK_DEFAULTS['text'][key]} (text)"


class _Parser(argparse.ArgumentParser):
    """--help lists every option; a mistake gets one usage line (the full one is 25 lines)."""

    def format_usage(self) -> str:  # used by error() and print_usage(); --help builds its own
        return f"usage: {self.prog} [options]; `{self.prog} --help` lists them\n"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ringtrain train", description="Train a GPT on 2-digit addition (default) or on your "
        "text (--data), on one or many processes. Every option has a default.")
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=_positive_int, default=1,
                   help="worker processes on this machine (default: 1)")
    g.add_argument("--threads", type=_positive_int,
                   help="torch threads per worker (default: CPU cores / --nproc-per-node; 1 is "
                   "faster for small models on a busy machine)")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where tensors live: auto is CUDA where torch sees a GPU (one per "
                   "process with NCCL), else the CPU (default: auto)")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="process-group backend: auto is NCCL on CUDA, gloo on the CPU; gloo with "
                   "--device cuda lets processes share a GPU, for testing (default: auto)")
    g.add_argument("--watchdog-timeout", type=non_negative_float, default=30.0,
                   help="stop every rank this many seconds after a peer went silent; 0 disables "
                   "(default: 30)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=0,
                   help="restart the workers up to this many times after a failure (default: 0)")
    g.add_argument("--nnodes", default="1",
                   help="machines in the job, as in `ringtrain run` (default: 1)")
    g.add_argument("--node-rank", type=_non_negative_int, default=0,
                   help="this machine's index in [0, --nnodes) (default: 0)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="node 0's address and a free port, the same on every node (--nnodes > 1)")
    g.add_argument("--rdzv-id", help="a job id, the same on every node (default: the run dir)")
    g.add_argument("--memory-limit", metavar="SIZE", type=_memory_size,
                   help="kill a worker that uses more than SIZE (e.g. 1.5G) of memory, and say so: "
                   "one memory cgroup per worker, needs root or a delegated cgroup (default: none)")
    g.add_argument("--shutdown-timeout", type=_non_negative_int, metavar="SECONDS",
                   help="after SIGTERM or SIGUSR1, how long the workers get to save a snapshot "
                   "and exit before the launcher kills them (default: 30)")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="FILE.txt|DIR",
                   help="LM on a `ringtrain prepare` directory (memory-mapped), or on a UTF-8 text "
                   "(char level, 90/10 split, prepared into RUN_DIR/data); default: addition")
    g.add_argument("--digits", type=_positive_int, default=None,
                   help="operand digits of the addition task, 1..3 (default: 2)")
    g.add_argument("--block-size", type=_positive_int, default=None,
                   help="context length for --data (default: 64)")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=_positive_int, help=_task_default("n_layer"))
    g.add_argument("--n-head", type=_positive_int, help=_task_default("n_head"))
    g.add_argument("--n-embd", type=_positive_int, help=_task_default("n_embd"))
    g.add_argument("--dropout", type=non_negative_float, help=_task_default("dropout"))
    g.add_argument("--tie-embeddings", action="store_true",
                   help="share the token embedding with the output layer (default: untied)")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                   help="biases in Linear and LayerNorm layers (default: --bias)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward instead of keeping its activations: "
                   "less memory, ~1/3 more compute, same gradients (default: off)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model once the strategy holds it: faster steps after "
                   "a compile of tens of seconds at the start (and again for evaluation); on a "
                   "CPU it needs a C++ compiler (default: off)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=_positive_int, help="optimizer steps; " + _task_default("steps"))
    g.add_argument("--batch-size", type=_positive_int,
                   help="samples per micro-batch per rank; " + _task_default("batch_size"))
    g.add_argument("--grad-accum", type=_positive_int, default=1,
                   help="micro-batches per optimizer step (default: 1)")
    g.add_argument("--lr", type=non_negative_float, help="peak learning rate; " + _task_default("lr"))
    g.add_argument("--min-lr", type=non_negative_float, help="final learning rate (default: lr / 10)")
    g.add_argument("--warmup-steps", type=_non_negative_int,
                   help="linear warmup steps (default: min(100, steps / 10))")
    g.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="after warmup (default: cosine)")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                   help="AdamW weight decay on matrices (default: 0.1)")
    g.add_argument("--beta1", type=non_negative_float,
                   help="AdamW's momentum (default: 0.9; 0.5 with --strategy ps --ps-mode async, "
                        "where asynchrony adds momentum of its own: docs/ps.md)")
    g.add_argument("--beta2", type=non_negative_float, default=0.95,
                   help="AdamW's second-moment decay (default: 0.95; nanoGPT's Shakespeare recipe: 0.99)")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                   help="max gradient norm, 0 disables (default: 1.0)")
    g.add_argument("--seed", type=int, default=1337, help="initialisation, data order, dropout "
                   "(default: 1337)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16 autocast where the device supports it (default: fp32)")
    g = p.add_argument_group("run")
    g.add_argument("--run-dir", help="where the run's files go (default: runs/<timestamp>)")
    g.add_argument("--log-every", type=_positive_int, help="steps between metric lines "
                   "(default: steps / 100)")
    g.add_argument("--eval-every", type=_positive_int, help="steps between evaluations "
                   "(default: steps / 10; the last step always evaluates)")
    g.add_argument("--eval-batch-size", type=_positive_int, help="default: max(batch size, 256)")
    g.add_argument("--stop-at-accuracy", type=non_negative_float, metavar="FRACTION",
                   help="stop once the held-out accuracy reaches this, e.g. 0.99 (addition only)")
    g.add_argument("--sample-length", type=_positive_int, default=300,
                   help="characters generated at the end with --data (default: 300)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--trace-steps", type=parse_steps, metavar="A:B",
                   help="record a timeline of steps A to B-1 on every rank (forward, backward, "
                   "each bucket's communication, optimizer) into RUN_DIR/trace.json, for "
                   "ui.perfetto.dev or chrome://tracing (default: off)")
    g = p.add_argument_group("fault tolerance")
    g.add_argument("--snapshot-every", type=_non_negative_int,
                   help="steps between snapshots in RUN_DIR/snapshots (also one on SIGTERM), 0: "
                   "none; " + _task_default("snapshot_every"))
    g.add_argument("--keep", type=_positive_int, default=2,
                   help="committed snapshots kept (default: 2: a corrupt newest one falls back)")
    g.add_argument("--no-resume", action="store_true",
                   help="start afresh in --run-dir, deleting its snapshots (default: resume from "
                   "its newest committed snapshot; a restarted worker always resumes)")
    g.add_argument("--record-samples", action="store_true",
                   help="record the sample indices of every step in the snapshots, to check "
                   "exactly-once data (ringtrain/data/sample_log.py; default: off)")
    g = p.add_argument_group("strategy")
    strategies = registered()
    g.add_argument("--strategy", choices=list(strategies), default="ddp",
                   help="how the model is distributed (default: ddp)")
    # Each strategy's own flags, declared by it; a flag several strategies share (diloco
    # extends localsgd) is listed once, under the first, naming every strategy that takes it.
    owners = _flag_owners(strategies)
    for name, cls in strategies.items():
        mine = [o for o in cls.options if owners[o.flag][0] == name]
        if mine:
            g = p.add_argument_group(f"--strategy {name}")
        for o in mine:
            shared = f" (--strategy {', '.join(owners[o.flag])})" if len(owners[o.flag]) > 1 else ""
            g.add_argument(o.flag, type=o.type, choices=o.choices, help=o.help + shared)
    return p


def _flag_owners(strategies: dict[str, type[Strategy]]) -> dict[str, list[str]]:
    """--flag -> the strategies that declare it, in registry order."""
    owners: dict[str, list[str]] = {}
    for name, cls in strategies.items():
        for o in cls.options:
            owners.setdefault(o.flag, []).append(name)
    return owners


def _strategy(args: argparse.Namespace) -> type[Strategy]:
    return registered()[args.strategy]


def task_name(args: argparse.Namespace) -> str:
    return "text" if args.data else "addition"


def check_args(args: argparse.Namespace, world_size: int | None = None) -> list[str]:
    """Errors the parser cannot see: flags that do not apply, an unusable data file.

    Raises ValueError naming the values and the fix; returns warnings (one line each): what is
    allowed but likely a mistake. Fills in the task's defaults.

    Args:
        world_size: the job's number of ranks where it is known before the workers start
            (--nnodes N x --nproc-per-node): the strategy's layout and the batch are checked
            against it too. None skips those checks.
    """
    warnings: list[str] = []
    cores = os.cpu_count() or 1
    if args.nproc_per_node > cores:
        warnings.append(f"--nproc-per-node {args.nproc_per_node} is more than this machine's "
                        f"{cores} CPU cores: the workers take turns on them and every step waits "
                        f"for the slowest; --nproc-per-node {cores} or fewer trains faster")
    _check_nodes(args)
    # Before any worker starts: NCCL with more processes than GPUs, or CUDA without one.
    choose(args.backend, args.device, local_world_size=args.nproc_per_node)
    if args.stop_at_accuracy is not None and not 0 < args.stop_at_accuracy <= 1:
        raise ValueError(f"--stop-at-accuracy {args.stop_at_accuracy}: a fraction of the held-out "
                         "sums, in (0, 1], e.g. 0.99")
    if args.nnodes != "1" and not (args.rdzv_endpoint and args.run_dir):
        raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address) "
                         "and --run-dir (the same path on every node, so ranks share snapshots)")
    task = task_name(args)
    for dest, value in TASK_DEFAULTS[task].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if task == "text":
        if args.digits is not None:
            raise ValueError("--digits applies to the addition task; drop it or drop --data")
        if args.stop_at_accuracy is not None:
            raise ValueError("--stop-at-accuracy needs the addition task (text has no accuracy); "
                             "drop it or drop --data")
        args.block_size = args.block_size or 64
        from ringtrain.cli.job import check_text_data

        train_samples = check_text_data(args.data, args.block_size, warnings)
    else:
        if args.block_size is not None:
            raise ValueError("--block-size applies to --data (the addition task fixes its own)")
        args.digits = args.digits or 2
        from ringtrain.data.addition import MAX_DIGITS, train_size

        if args.digits > MAX_DIGITS:
            raise ValueError(f"--digits {args.digits}: the addition task supports 1..{MAX_DIGITS}")
        train_samples = train_size(args.digits)
    strategies = registered()
    mine = {o.flag for o in strategies[args.strategy].options}
    for flag, names in _flag_owners(strategies).items():
        if flag not in mine and getattr(args, flag[2:].replace("-", "_")) is not None:
            which = " or ".join(f"--strategy {n}" for n in names)
            raise ValueError(f"{flag} applies to {which}, not {args.strategy}; "
                             f"add {which.split(' or ')[0]} or drop {flag}")
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}; "
                         "choose --n-embd as a multiple of --n-head")
    if args.dropout >= 1:
        raise ValueError(f"--dropout {args.dropout}: it must be below 1")
    try:
        trainer_config(args).resolved()
    except ValueError as e:  # say it with the flag's name: "lr=0.0" -> "--lr 0.0"
        raise ValueError("--" + str(e).replace("_", "-").replace("=", " ", 1)) from None
    if args.warmup_steps is not None and args.warmup_steps > args.steps:
        warnings.append(f"--warmup-steps {args.warmup_steps} is more than --steps {args.steps}: "
                        f"the learning rate never reaches --lr {args.lr}; lower --warmup-steps")
    if args.trace_steps is not None and args.trace_steps.start > args.steps:
        warnings.append(f"--trace-steps {args.trace_steps} starts after the run's last step "
                        f"({args.steps}): the trace will be empty; pick steps up to {args.steps}")
    if world_size is not None:
        _check_layout(args, world_size, train_samples)
    return warnings


def _check_nodes(args: argparse.Namespace) -> None:
    """--nnodes N or MIN:MAX, --node-rank below N, --rdzv-endpoint HOST:PORT."""
    parts = args.nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
        raise ValueError(f"--nnodes {args.nnodes}: give the number of machines (2) or a range "
                         "MIN:MAX for an elastic job (1:4)")
    if args.node_rank >= int(parts[-1]):
        raise ValueError(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: number "
                         f"the machines 0..{int(parts[-1]) - 1}, node 0 at --rdzv-endpoint")
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    if args.rdzv_endpoint and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint}: give node 0's address and a free "
                         "port as HOST:PORT, e.g. 10.0.0.1:29400")


def _check_layout(args: argparse.Namespace, world_size: int, train_samples: int) -> None:
    """What the workers would otherwise find one by one: a strategy layout that does not fit
    `world_size` (the strategy's own `plan`), a micro-batch larger than one data rank's share
    of the training set."""
    data_world_size = _strategy(args).plan(strategy_options(args), world_size,
                                           args.batch_size * args.grad_accum)
    per_rank = -(-train_samples // data_world_size)  # the sampler pads the last rank's share
    if per_rank < args.batch_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is more than one data rank's share of the training "
            f"set: {train_samples} samples over {data_world_size} data rank"
            f"{'s' if data_world_size > 1 else ''} is {per_rank} each; use --batch-size "
            f"{per_rank} or less, fewer ranks, or more data")


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen strategy's own options, only those set on the command line."""
    options = _strategy(args).options
    return {o.name: getattr(args, o.dest) for o in options if getattr(args, o.dest) is not None}


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command line for a relaunched worker: every set option except the launcher's."""
    out: list[str] = []
    for dest, value in vars(args).items():
        if dest in LAUNCHER_FLAGS or value is None or (value is False and dest not in _NEGATABLE):
            continue
        if value is False:  # --no-bias
            out.append("--no-" + dest.replace("_", "-"))
            continue
        flag = "--" + dest.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def tolerated_ranks(args: argparse.Namespace, world_size: int | None = None) -> frozenset[int]:
    """Global ranks the job survives losing (the strategy's `tolerated_ranks_for`).

    `world_size` defaults to --nnodes x --nproc-per-node; an elastic --nnodes MIN:MAX has no
    fixed layout, so nothing is tolerated there.
    """
    try:
        if world_size is None:
            world_size = int(args.nnodes) * args.nproc_per_node
    except ValueError:  # elastic --nnodes
        return frozenset()
    return _strategy(args).tolerated_ranks_for(strategy_options(args), world_size)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The options (besides the trainer's) that must equal a snapshot's to resume from it."""
    keys = ("digits", "block_size", "n_layer", "n_head", "n_embd", "dropout", "tie_embeddings", "bias")
    return {"data": os.path.abspath(args.data) if args.data else None,
            **{k: getattr(args, k) for k in keys}}


def default_beta1(args: argparse.Namespace) -> float:
    """AdamW's beta1 unless --beta1 is given: 0.9, or the chosen strategy's default."""
    return _strategy(args).trainer_defaults(strategy_options(args)).get("beta1", 0.9)


def trainer_config(args: argparse.Namespace):
    from ringtrain.training.trainer import TrainerConfig

    return TrainerConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
        weight_decay=args.weight_decay, beta1=default_beta1(args) if args.beta1 is None else args.beta1,
        beta2=args.beta2,
        grad_clip=args.grad_clip, seed=args.seed, dtype=args.dtype,
        log_every=args.log_every, eval_every=args.eval_every, eval_batch_size=args.eval_batch_size,
        progress=not args.no_progress, record_samples=args.record_samples,
        compile=args.compile)
