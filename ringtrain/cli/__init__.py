"""The `ringtrain` command: `ringtrain run ...` (launcher), `ringtrain train ...` (main job),
`ringtrain prepare` / `ringtrain sample` (text -> tokens, a run's model -> text),
`ringtrain export` (a run's model as a transformers GPT-2 or a torch distributed checkpoint),
`ringtrain explain RUN_DIR` (what a run did) and `ringtrain plan ...` (memory per rank).

This `__init__` dispatches. `ringtrain train`, in reading order: `train.py` (parse, check,
the run directory), `options.py` (every option, one dataclass field each; the strategies' own
come from their `Config`s), `train_args.py` (the command line made from them, and the checks
across sections), `relaunch.py` (the typed command or a launched worker; starting the workers
through the launcher), `worker.py` (`run_job`: one worker's part of the job), `job.py` (what
is trained), `exits.py` (exit codes, a mistake said once), `step_hook.py` (a function of the
user's after every step, RINGTRAIN_STEP_HOOK). `explain.py` reads a run directory
(`explain_words.py`: what it says of each strategy); `prepare.py` and `sample.py` turn text
into tokens and a run's model into text; `export.py` writes a run's model in the ecosystem's
formats (`ringtrain.formats`); `plan.py` predicts memory per rank. `ringtrain run`
is `ringtrain.launch.launcher`. The CLI is the top: it may import most packages
(docs/architecture.md's table says which); only `python -m ringtrain` imports it.

    ringtrain run --nproc-per-node 2 my_script.py --my-arg 1
    ringtrain train --nproc-per-node 2
    ringtrain explain runs/20261121-220741
    ringtrain plan --help
"""

from __future__ import annotations

import os
import signal
import sys

_USAGE = """usage: ringtrain {run,train,prepare,sample,export,explain,plan} ...

  run     launch a script on N processes (torchrun's flags), e.g.
          ringtrain run --nproc-per-node 2 train.py
  train   train a GPT with any strategy on the embedded default task or your own text, e.g.
          ringtrain train --nproc-per-node 2
  prepare tokenize a text file or folder (char or BPE) into train.bin/val.bin, e.g.
          ringtrain prepare input.txt data/shakespeare
  sample  generate text with a trained run's model, e.g.
          ringtrain sample runs/20261121-220741 --prompt "ROMEO:" --tokens 200
  export  write a run's model as a transformers GPT-2 directory or a torch distributed
          checkpoint, e.g. ringtrain export runs/20261121-220741 gpt2_dir --format hf
  explain say what a `ringtrain train` run did: ranks' roles, data split, bytes sent, timing,
          the snapshot a resume would use, e.g. ringtrain explain runs/20261121-220741
  plan    predict memory, bytes sent and step time per rank of every strategy and every
          dp x pp x tp layout of a GPT, and which fit a memory budget, e.g.
          ringtrain plan --nproc-per-node 8 --n-layer 24 --n-embd 2048 --n-head 16 --memory-gb 40

`ringtrain COMMAND --help` lists a command's options."""


def main(argv: list[str] | None = None) -> int:
    try:
        return _command(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # `ringtrain explain RUN | head`: the reader has what it wanted
        # Python's own advice: stdout to /dev/null, so the flush at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a shell reports for a tool the pipe ended


def _command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from ringtrain.launch.launcher import main as run_main

        return run_main(rest)
    if command == "train":
        from ringtrain.cli.train import main as train_main

        return train_main(rest)
    if command == "explain":
        from ringtrain.cli.explain import main as explain_main

        return explain_main(rest)
    if command == "plan":
        from ringtrain.cli.plan import main as plan_main

        return plan_main(rest)
    if command == "prepare":
        from ringtrain.cli.prepare import main as prepare_main

        return prepare_main(rest)
    if command == "sample":
        from ringtrain.cli.sample import main as sample_main

        return sample_main(rest)
    if command == "export":
        from ringtrain.cli.export import main as export_main

        return export_main(rest)
    print(f"ringtrain: unknown command {command!r}; expected 'run', 'train', 'prepare', "
          f"'sample', 'export', 'explain' or 'plan'\n\n{_USAGE}", file=sys.stderr)
    return 2


def run_and_end() -> None:
    """`python -m ringtrain`: run the command; a launched worker then ends at once, its results
    and output flushed.

    Everything a worker must leave behind (summary.json, report.png, snapshots, metrics) is
    written and fsynced before `main` returns, and the process group is torn down. What
    remains is interpreter shutdown, in which a communication thread of torch's can still
    abort the process (SIGABRT) and turn a finished run into a failed one: a worker skips it.
    """
    from ringtrain.launch.ending import end_now, exit_code

    code = exit_code(main)
    if "LOCAL_RANK" not in os.environ:  # not a launched worker: an ordinary exit
        sys.exit(code)
    end_now(code)


if __name__ == "__main__":
    sys.exit(main())
