"""An unknown flag's error names the flag meant: `--stpes 10` -> "did you mean --steps?".

    parser = suggest_flags(argparse.ArgumentParser(prog="ringtrain train"))

argparse says only "unrecognized arguments: --stpes 10" (Python 3.14 learns to suggest, for
choices only). A user who typed a flag from another tool (`--resume`, `--epochs`, `--nprocs`)
learns what ringtrain calls it, or that it is the default. The parser's own error() is
wrapped, so every caller (parse_args, parse_known_args, a subparser) gets the hint.
"""

from __future__ import annotations

import argparse
import difflib
import re

# Flags of other tools and scripts, and what ringtrain offers instead: said where the parser has
# every flag the sentence names (tests/test_flag_hints.py shows each one with `ringtrain train`,
# so a renamed flag fails there rather than silently dropping its hint).
OTHER_TOOLS = {
    "--resume": "resuming is the default: `ringtrain train` resumes from --run-dir's newest "
                "committed snapshot (--resume-from STEP goes back to an earlier one, "
                "--no-resume starts afresh)",
    "--epochs": "ringtrain train counts optimizer steps: --steps (`ringtrain explain RUN_DIR` "
                "says how many steps an epoch is)",
    "--max-steps": "did you mean --steps?",
    "--nprocs": "did you mean --nproc-per-node?",
    "--gpus": "use --nproc-per-node (one process per GPU)",
    "--world-size": "use --nproc-per-node and --nnodes (the world size is their product)",
}
for _spelling in ("--local-rank", "--local_rank"):  # torch.distributed.launch passed it; not us
    OTHER_TOOLS[_spelling] = ("not needed: every worker reads LOCAL_RANK from its environment "
                              "(ringtrain.init_distributed() does)")


def hint(parser: argparse.ArgumentParser, unknown: str) -> str | None:
    """What to say about one unknown argument (`--stpes`, `--lr-shedule=0.1`), or None."""
    name = unknown.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    known = [s for s in parser._option_string_actions if s.startswith("--")]  # argparse's table
    if name in OTHER_TOOLS:
        said = OTHER_TOOLS[name]
        offered = re.findall(r"--[a-z][a-z0-9-]*", said)
        if all(flag in known for flag in offered):  # a flag this parser lacks: not offered
            return f"{name}: {said}"
    # One spelling of each (torchrun's flags come as --nproc-per-node and --nproc_per_node).
    dashed = list(dict.fromkeys(flag.replace("_", "-") for flag in known))
    typed = name.replace("_", "-")
    # An abbreviation, where the parser takes none (`ringtrain train`): the flags it begins.
    close = [flag for flag in dashed if flag.startswith(typed)][:3]
    close = close or difflib.get_close_matches(typed, dashed, n=2, cutoff=0.75)
    if close:
        return f"{name}: did you mean {' or '.join(close)}?"
    return None


def suggest_flags(parser: argparse.ArgumentParser,
                  otherwise: str | None = None) -> argparse.ArgumentParser:
    """`parser`, whose "unrecognized arguments" error adds a hint for each unknown flag, or
    `otherwise` when none has one (`ringtrain run`: a script's flags go after its name)."""
    error = parser.error

    def with_hints(message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = [h for arg in message[len(prefix):].split() if (h := hint(parser, arg))]
            if hints or otherwise:
                message += "; " + "; ".join(hints or [otherwise])
        return error(message)

    parser.error = with_hints  # type: ignore[method-assign]
    return parser
