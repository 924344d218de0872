"""The options of `ringtrain train`, as one tree of dataclasses: the only place they are defined.

    opts = parse_options(["--nproc-per-node", "2", "--lr", "1e-3"])   # -> TrainOptions
    opts.trainer.lr, opts.model.n_layer, opts.strategy.kwargs()

Sections: `launch`, `data`, `model` and `run` below, `trainer` (`training.TrainerConfig`), and
`strategy`, the chosen strategy's own `Config` (declared in its module). Each field carries its
flag, type, default, help and resume rule (`ringtrain.config.option`); the parser, config.json,
the workers, the resume check and docs/train.md's table are generated from them.

Defaults apply in this order, each replacing the one before: the field's, the task's
(`TASK_DEFAULTS`: only where a task differs; --help shows both from there), the strategy's
trainer defaults (ps async: beta1 0.5), the recipe's (`--recipe`), the command line's. Each
default is written once: a library class's own (`TrainerConfig`, the GPT's shape from
`GPTConfig`, the addition task's digits from `AdditionDataset`) is read from it, not retyped.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ringtrain.config import (
    MUST_MATCH,
    check_values,
    dest,
    int_at_least,
    non_negative_float,
    option,
)
from ringtrain.config.fields import default_text, meta, option_fields
from ringtrain.data.addition import DEFAULT_DIGITS, MAX_DIGITS
from ringtrain.launch.device import BACKENDS, DEVICES
from ringtrain.models.gpt import GPTConfig
from ringtrain.strategies import StrategyConfig, registered
from ringtrain.trace import StepRange, parse_steps
from ringtrain.training.config import TrainerConfig

_positive, _non_negative = int_at_least(1), int_at_least(0)


def _nproc(text: str) -> int:
    """--nproc-per-node: a number, or torchrun's `gpu` (one per GPU) and `auto` (one per GPU,
    else one per CPU core), resolved here so config.json records the number."""
    if text not in ("gpu", "auto"):
        return _positive(text)
    import os

    from ringtrain.launch.device import launcher_gpu_count

    if gpus := launcher_gpu_count():
        return gpus
    if text == "gpu":
        import torch

        raise argparse.ArgumentTypeError(f"gpu: torch {torch.__version__} sees no GPU on this "
                                         "machine; give a number of processes, or auto")
    return os.cpu_count() or 1


_nproc.rule = _positive.rule  # type: ignore[attr-defined]


def _memory_size(text: str) -> str:
    from ringtrain.launch.cgroup import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# Where a task of the command line differs from the fields' defaults, and only there: a value
# equal to the field's would be the same default written twice (tests/test_options.py).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # The fields' GPT (GPTConfig's defaults) on 2-digit sums: it reaches 100 % held-out
    # accuracy by step ~700 of 1000 on 2 processes (seeds 1-3, 1337) at this lr.
    "addition": {"steps": 1000, "lr": 3e-3, "digits": DEFAULT_DIGITS},
    # nanoGPT's CPU recipe for Shakespeare characters (its README: block 64, batch 12, 4 x 128,
    # 2000 steps, dropout 0; beta2 0.99 from config/train_shakespeare_char.py, which that
    # recipe keeps); the rest of it (2000 steps, lr 1e-3, 4 heads, dropout 0) is the fields'
    # defaults, and tests/test_options.py checks the whole. Not matched: nanoGPT has no biases
    # and ties the output layer; this preset keeps ringtrain's model (--recipe
    # shakespeare_char is nanoGPT's whole model).
    "text": {"n_layer": 4, "n_embd": 128, "batch_size": 12, "beta2": 0.99,
             "snapshot_every": 200, "block_size": 64},
}
_GPT = {f.name: f.default for f in fields(GPTConfig)}  # the model's own defaults, not retyped


@dataclass(kw_only=True)
class LaunchOptions:
    """How many processes, where, and how they are watched (`launcher`: the launcher's alone)."""

    nproc_per_node: int = option(1, "worker processes on this machine (gpu: one per GPU; auto: "
                                 "one per GPU, else one per CPU core)", type=_nproc,
                                 launcher=True)
    threads: int | None = option(None, "torch threads per worker (1 is faster for small models "
                                 "on a busy machine)", type=_positive, shown="cores / nproc")
    device: str = option("auto", "where tensors live: auto is CUDA where torch sees a GPU (one "
                         "per process with NCCL), else the CPU", choices=DEVICES)
    backend: str = option("auto", "process-group backend: auto is NCCL on CUDA, gloo on the CPU; "
                          "gloo with --device cuda lets processes share a GPU", choices=BACKENDS)
    watchdog_timeout: float = option(30.0, "stop every rank this long (s) after a peer went "
                                     "silent; 0 disables", type=non_negative_float)
    max_restarts: int = option(0, "restart the workers up to this many times after a failure",
                               type=_non_negative, launcher=True)
    live: bool = option(False, "live recovery: when a worker dies or hangs, the others go on "
                        "from memory over a new group and the launcher starts a replacement, "
                        "which heals from a live peer (ddp, zero, localsgd, diloco; "
                        "docs/fault_tolerance.md)")
    live_wait: float = option(0.0, "with --live: seconds the survivors wait for a replacement "
                              "before going on without it (0: at once; waiting keeps every "
                              "step's sums those of the fault-free run)", type=non_negative_float,
                              metavar="S")
    live_dead_after: float | None = option(
        None, "with --live: a worker whose heartbeat (every 0.1 s, from a thread) has not moved "
        "for S seconds is lost (a SIGSTOP, a lost link): the others regroup without it. Raise it "
        "where a worker may stop its threads that long (long garbage collections)",
        type=non_negative_float, metavar="S", shown="0.5, at most --watchdog-timeout / 2")
    live_spares: int = option(0, "with --live: warm spares per node, started with the workers "
                              "(imported, built, waiting): a lost worker's place is taken by one "
                              "at once instead of after a process start (~2.5 s here); each "
                              "holds a worker's memory while it waits", type=_non_negative,
                              metavar="N", launcher=True)
    cold_starts: bool = option(False, "start each worker as a fresh interpreter (~6 s of a core "
                               "importing torch), not forked from a warm process that imported "
                               "it once for the job (ringtrain.launch.starts)", launcher=True)
    nnodes: str = option("1", "machines in the job: N, or MIN:MAX (elastic)", launcher=True)
    node_rank: int = option(0, "this machine's index in [0, nnodes)", type=_non_negative,
                            launcher=True)
    rdzv_endpoint: str | None = option(None, "node 0's address and a free port, the same on every "
                                       "node", metavar="HOST:PORT", launcher=True)
    rdzv_id: str | None = option(None, "a job id, the same on every node", shown="the run dir",
                                 launcher=True)
    memory_limit: str | None = option(None, "kill a worker that uses more than SIZE (e.g. 1.5G), "
                                      "and say so (a memory cgroup per worker: root or delegation)",
                                      metavar="SIZE", type=_memory_size, launcher=True)
    shutdown_timeout: int | None = option(None, "after SIGTERM or SIGUSR1, seconds the workers "
                                          "get to save and exit", type=_non_negative, shown="30",
                                          launcher=True)

    def __post_init__(self) -> None:
        check_values(self)
        parts = self.nnodes.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or \
                int(parts[0]) > int(parts[-1]):
            raise ValueError(f"nnodes={self.nnodes}: give the number of machines (2) or a range "
                             "MIN:MAX for an elastic job (1:4)")
        if self.node_rank >= int(parts[-1]):
            raise ValueError(f"node_rank={self.node_rank} is not below nnodes={self.nnodes}: "
                             f"number the machines 0..{int(parts[-1]) - 1}, node 0 at "
                             "rdzv_endpoint")
        host, _, port = (self.rdzv_endpoint or "").rpartition(":")
        if self.rdzv_endpoint and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"rdzv_endpoint={self.rdzv_endpoint}: give node 0's address and a "
                             "free port as HOST:PORT, e.g. 10.0.0.1:29400")


@dataclass(kw_only=True)
class DataOptions:
    """What is learnt: the addition task, or a text (`data`)."""

    data: str | None = option(None, "LM on a `ringtrain prepare` dir (memory-mapped) or a UTF-8 "
                              "text (char level, 90/10 split)", metavar="FILE.txt|DIR",
                              shown="the addition task", resume=MUST_MATCH)
    digits: int | None = option(None, f"operand digits of the addition task, 1..{MAX_DIGITS}",
                                type=_positive, resume=MUST_MATCH)
    block_size: int | None = option(None, "context length for --data", type=_positive,
                                    resume=MUST_MATCH)

    @property
    def task(self) -> str:
        return "text" if self.data else "addition"

    def __post_init__(self) -> None:
        check_values(self)
        if self.data:
            if self.digits is not None:
                raise ValueError("digits applies to the addition task; drop it or drop data")
            return
        if self.block_size is not None:
            raise ValueError("block_size applies to data (the addition task fixes its own)")
        if self.digits is not None and self.digits > MAX_DIGITS:
            raise ValueError(f"digits={self.digits}: the addition task supports 1..{MAX_DIGITS}")


@dataclass(kw_only=True)
class ModelOptions:
    """The GPT (`ringtrain.models.GPTConfig`, less what the data fixes)."""

    n_layer: int = option(_GPT["n_layer"], "transformer blocks", type=_positive,
                          resume=MUST_MATCH)
    n_head: int = option(_GPT["n_head"], "attention heads", type=_positive, resume=MUST_MATCH)
    n_embd: int = option(_GPT["n_embd"], "embedding width", type=_positive, resume=MUST_MATCH)
    dropout: float = option(_GPT["dropout"], "dropout probability", type=non_negative_float,
                            resume=MUST_MATCH)
    tie_embeddings: bool = option(_GPT["tie_embeddings"], "share the token embedding with the "
                                  "output layer", resume=MUST_MATCH)
    bias: bool = option(_GPT["bias"], "biases in Linear and LayerNorm layers", negatable=True,
                        resume=MUST_MATCH)
    # Megatron-LM's --make-vocab-size-divisible-by, nanoGPT's 50304: the data fixes the tokens,
    # this the rows (tensor parallelism splits them; GPUs favour multiples of 64).
    pad_vocab: int = option(1, "round the model's vocabulary up to a multiple of N: rows no "
                            "token uses, never sampled (--tp must divide the rows; 64 suits "
                            "GPUs)", type=_positive, metavar="N", resume=MUST_MATCH)
    activation_checkpointing: bool = option(_GPT["activation_checkpointing"], "recompute each "
                                            "block in backward: less memory, ~1/3 more "
                                            "compute, same gradients")

    def __post_init__(self) -> None:
        check_values(self)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             "choose n_embd as a multiple of n_head")
        if self.dropout >= 1:
            raise ValueError(f"dropout={self.dropout}: it must be below 1")

    def vocab_rows(self, tokens: int) -> int:
        """The model's vocab_size for data of `tokens` token ids: rounded up to pad_vocab."""
        return -(-tokens // self.pad_vocab) * self.pad_vocab


@dataclass(kw_only=True)
class RunOptions:
    """The run directory, snapshots, what is recorded, and which strategy."""

    run_dir: str | None = option(None, "where the run's files go", shown="runs/<timestamp>")
    recipe: str | None = option(None, "a named set of options (ringtrain/config/recipes/) or "
                                "a .py file of them; the command line overrides it")
    strategy: str = option("ddp", "how the model is distributed; unset, --pp chooses pipeline "
                           "(its --tp splits each stage) and --tp alone tp",
                           choices=tuple(registered()))
    stop_at_accuracy: float | None = option(None, "stop once the held-out accuracy reaches this, "
                                            "e.g. 0.99 (addition); run again, a stopped run trains "
                                            "nothing, a higher value goes on from its stop",
                                            type=non_negative_float,
                                            metavar="FRACTION")
    sample_length: int = option(300, "characters generated at the end with --data", type=_positive)
    trace_steps: StepRange | None = option(None, "record a timeline of steps A to B-1 on every "
                                           "rank into RUN_DIR/trace.json (ui.perfetto.dev)",
                                           type=parse_steps, metavar="A:B")
    snapshot_every: int = option(100, "steps between snapshots in RUN_DIR/snapshots (and one "
                                 "after the last step and on SIGTERM), 0: none",
                                 type=_non_negative)
    sync_snapshots: bool = option(False, "write each snapshot in the step (the step waits for "
                                  "the disk); by default the step copies the state to host "
                                  "memory and a thread writes and commits it")
    keep: int = option(2, "committed snapshots kept (2: a corrupt newest one falls back)",
                       type=_positive)
    # Not resume=MUST_MATCH: a resume takes its snapshot's weights, whatever started the run.
    init_from: str | None = option(None, "start from the weights in DIR: a transformers GPT-2 "
                                   "directory, a torch distributed checkpoint (.metadata) or an "
                                   "exported ringtrain run, whose shape the model takes where no "
                                   "option sets it; --data must be tokenized as its (ringtrain "
                                   "prepare --tokenizer-from DIR)",
                                   metavar="DIR", shown="random (GPT-2's init)")
    resume: bool = option(True, "start afresh in --run-dir; the earlier run there (snapshots, "
                          "metrics, summary, model) moves to RUN_DIR/set-aside/, nothing is "
                          "deleted (a restarted worker always resumes)", flag="--no-resume",
                          shown="resume from --run-dir's newest committed snapshot")
    resume_from: int | None = option(None, "resume from the committed snapshot of step STEP, "
                                     "not the newest: the later snapshots (and the final model, "
                                     "summary and a copy of metrics.jsonl) move to "
                                     "RUN_DIR/set-aside/, nothing is deleted; once per command "
                                     "(a restart goes on from the newest)", type=_non_negative,
                                     metavar="STEP", shown="the newest")

    def __post_init__(self) -> None:
        check_values(self)
        if self.resume_from is not None and not self.resume:
            raise ValueError(f"--resume-from {self.resume_from} with --no-resume: one resumes "
                             "from a snapshot, the other sets them all aside; keep one")
        if (self.init_from and self.run_dir
                and os.path.realpath(self.init_from) == os.path.realpath(self.run_dir)):
            # a resume takes the snapshot's weights; --no-resume would set the model aside first
            raise ValueError(f"--init-from {self.init_from} is --run-dir itself: drop "
                             "--init-from to resume that run, or start a new run from its "
                             f"final model in another --run-dir (--init-from {self.init_from} "
                             "--run-dir NEW)")
        if self.resume_from is not None and self.run_dir is None:
            raise ValueError(f"--resume-from {self.resume_from} needs --run-dir: the run whose "
                             "snapshot of that step to go on from")
        if self.stop_at_accuracy is not None and not 0 < self.stop_at_accuracy <= 1:
            raise ValueError(f"stop_at_accuracy={self.stop_at_accuracy}: a fraction of the "
                             "held-out sums, in (0, 1], e.g. 0.99")


SECTIONS: dict[str, type] = {"launch": LaunchOptions, "data": DataOptions, "model": ModelOptions,
                             "trainer": TrainerConfig, "run": RunOptions}


@dataclass(kw_only=True)
class TrainOptions:
    """Every option of `ringtrain train`, by section; `strategy` is the chosen one's config."""

    launch: LaunchOptions = field(default_factory=LaunchOptions)
    data: DataOptions = field(default_factory=DataOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunOptions = field(default_factory=RunOptions)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)

    @property
    def task(self) -> str:
        return self.data.task

    def sections(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    def flat(self, *, launcher: bool = False) -> dict[str, Any]:
        """{dest: value} of every option (config.json's "args"; the launcher's with `launcher`)."""
        return {dest(f): _jsonable(getattr(s, f.name)) for s in self.sections()
                for f in option_fields(s) if launcher or not meta(f)["launcher"]}


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def every_option_class() -> list[type]:
    """The sections and every registered strategy's config (for the parser and `to_flags`)."""
    return [*SECTIONS.values(), *(cls.Config for cls in registered().values())]


def per_task_text(f) -> str | None:
    """--help's default of a field: "1000 (addition) / 2000 (text)" where a task changes it
    (the field's own default for a task that does not; a task without one is left out)."""
    if not any(f.name in v for v in TASK_DEFAULTS.values()):
        return default_text(f)
    shown = {task: v.get(f.name, f.default) for task, v in TASK_DEFAULTS.items()}
    return " / ".join(f"{value} ({task})" for task, value in shown.items() if value is not None)
