"""One option = one dataclass field: `option()` stores the rest of what the command line needs.

    @dataclass(kw_only=True)
    class Example:
        steps: int = option(1000, "optimizer steps", type=int_at_least(1), resume=MUST_MATCH)

    parser = argparse.ArgumentParser(); add_section(parser, Example)   # --steps, with its help
    set_values(Example, vars(parser.parse_args(["--steps", "5"])))     # {"steps": 5}

The flag is `--` + the field's name with dashes unless the field names another (a strategy's
`mode` is `--ps-mode`). Every generated argument defaults to None, so "not given" is visible and
the defaults apply in one place, in order: the field's default, the task's (the command line's
`TASK_DEFAULTS`: only what differs from the field's), the recipe's, then the command line. An
option class checks itself on construction (`check_values`: the field's own type and choices,
the same rules the command line's parser applies to typed text), so a config built in a script,
a recipe or config.json meets them too. Errors raised by the option classes name fields
(`lr=0.0: ...`); `to_flags` says them with flags (`--lr 0.0: ...`) for the command line.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, field, fields
from typing import Any

MUST_MATCH = "must_match"  # `resume=`: a snapshot resumes only with the same value
SCHEDULE = "schedule"  # `resume=`: as MUST_MATCH, unless the resume asks for a new schedule


def option(default: Any, help: str, *, flag: str | None = None,
           type: Callable[[str], Any] | None = None, choices: Iterable[Any] | None = None,
           metavar: str | None = None, shown: str | None = None, resume: str | None = None,
           launcher: bool = False, negatable: bool = False) -> Any:

    """A dataclass field that is also a command-line option.

    Args:
        default: the library's default (the command line's too, unless a task changes it:
            `cli.options.TASK_DEFAULTS`).
        help: what it does, without the default (generated from `default` or `shown`).
        flag: the flag when it is not `--` + the name with dashes.
        type: parses the text (an argparse type); default: the default's type. `check_values`
            applies it to a value given in Python too.
        shown: the default as --help says it when it is derived ("lr / 10"); for a bool that
            is on by default and whose `flag` turns it off (`--no-progress`), what happens
            without the flag ("a bar on rank 0"), while `help` says what the flag does.
        resume: MUST_MATCH when a snapshot may only be resumed with the same value; SCHEDULE
            for the learning-rate schedule's, which --new-schedule lets a resume change.
        launcher: read by the launcher only; not in config.json's options, not for the workers.
        negatable: a `--x/--no-x` pair (a bool that defaults to True).
    """
    if default is True and not negatable and shown is None:
        # "--no-progress: draw the progress bar (default: on)" read as the opposite of the flag.
        raise TypeError(f"option({help!r}): a flag that turns a default-on bool off needs "
                        "shown= (what happens without it); its help says what the flag does")
    meta = {"help": help, "flag": flag, "type": type,
            "choices": tuple(choices) if choices else None,
            "metavar": metavar, "shown": shown, "resume": resume, "launcher": launcher,
            "negatable": negatable}
    return field(default=default, metadata={"option": meta})


def option_fields(cls: Any) -> list[Field]:
    """The fields of a dataclass (class or instance) that are options, in declaration order."""
    return [f for f in fields(cls) if "option" in f.metadata]


def meta(f: Field) -> dict[str, Any]:
    return f.metadata["option"]


def flag(f: Field) -> str:
    return meta(f)["flag"] or "--" + f.name.replace("_", "-")


def dest(f: Field) -> str:
    """The key of the option in argparse's namespace and in config.json: the flag's words
    (`--ps-mode`: ps_mode, unique over every strategy), a bool's own name (`--no-progress`:
    progress, holding the field's value)."""
    return f.name if isinstance(f.default, bool) else flag(f)[2:].replace("-", "_")


def resume_fields(cls: Any) -> tuple[str, ...]:
    """Names of the fields a resume must match (`resume=MUST_MATCH`, or `SCHEDULE`)."""
    return tuple(f.name for f in option_fields(cls) if meta(f)["resume"] in (MUST_MATCH, SCHEDULE))


def schedule_fields(cls: Any) -> tuple[str, ...]:
    """Names of the learning-rate schedule's fields (`resume=SCHEDULE`)."""
    return tuple(f.name for f in option_fields(cls) if meta(f)["resume"] == SCHEDULE)


def default_text(f: Field) -> str | None:
    m = meta(f)
    if m["shown"] is not None:
        return m["shown"]
    if f.default is MISSING or f.default is None:
        return None
    if isinstance(f.default, bool):
        return ("--" if f.default else "--no-") + flag(f)[2:] if m["negatable"] else \
            ("on" if f.default else "off")
    return str(f.default)


def add_section(parser: argparse.ArgumentParser, cls: Any, title: str, *,
                shown: Callable[[Field], str | None] = default_text,
                skip: Iterable[str] = ()) -> None:
    """Add `cls`'s options as one group titled `title` (flags in `skip` are left out: another
    group has them). Every argument defaults to None: unset is visible (`set_values`)."""
    group = parser.add_argument_group(title)
    for f in option_fields(cls):
        if flag(f) in skip:
            continue
        m = meta(f)
        default = shown(f)
        text = m["help"] + (f" (default: {default})" if default is not None else "")
        kwargs: dict[str, Any] = {"dest": dest(f), "default": None, "help": text}
        if isinstance(f.default, bool):
            # A bool flag turns the default over: --compile, --no-progress; --bias/--no-bias both.
            kwargs["action"] = argparse.BooleanOptionalAction if m["negatable"] else "store_const"
            if not m["negatable"]:
                kwargs["const"] = not f.default
        else:
            parse = m["type"] or (type(f.default) if f.default not in (None, MISSING) else str)
            # A short metavar (N, X) keeps each option on one line of --help.
            short = "N" if "int" in str(f.type) else "X" if "float" in str(f.type) else None
            kwargs.update(type=parse, choices=m["choices"], metavar=m["metavar"] or short)
        group.add_argument(flag(f), **kwargs)


def set_values(cls: Any, given: dict[str, Any]) -> dict[str, Any]:
    """{field name: value} of `cls`'s options present (not None) in `given` (keyed by dest)."""
    return {f.name: given[dest(f)] for f in option_fields(cls) if given.get(dest(f)) is not None}


def check_values(obj: Any) -> None:
    """Check a dataclass's option values as the command line's parser checks typed text: the
    field's `type` (`int_at_least(1)`: a positive integer), its `choices`, a bool for a flag.
    Call it first in `__post_init__`. Raises ValueError naming the field, the value and the
    rule (`steps=0: it must be a positive integer`).

    None is allowed where the field's default or annotation allows it ("derived", "off").
    """
    for f in option_fields(obj):
        value, m = getattr(obj, f.name), meta(f)
        if value is None:
            if f.default is None or "None" in str(f.type):
                continue
            raise ValueError(f"{f.name}=None: give a value (default: {default_text(f)})")
        if isinstance(f.default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{f.name}={value!r}: it must be True or False")
            continue
        if m["choices"] and value not in m["choices"]:
            raise ValueError(f"{f.name}={value!r}: use {' or '.join(map(repr, m['choices']))}")
        parse = m["type"]
        if parse is None:
            continue
        # The parser reads text: a value's text is what a flag would have typed (True is no
        # integer, 2.0 no step count).
        try:
            parse(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            unset = " (or None)" if f.default is None else ""
            rule = getattr(parse, "rule", None)
            raise ValueError(f"{f.name}={value!r}: " + (f"it must be {rule}{unset}" if rule
                                                          else str(e))) from None


def to_flags(message: str, classes: Iterable[Any]) -> str:
    """A library message in the command line's words: `lr=0.0` -> `--lr 0.0`, and a field name
    with an underscore (`min_lr`) -> its flag. The one place that maps fields to flags."""
    flags = {f.name: flag(f) for cls in classes for f in option_fields(cls)}
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    message = re.sub(rf"(?<![\w-])({names})=", lambda m: flags[m.group(1)] + " ", message)
    return re.sub(rf"(?<![\w-])({names})(?![\w=])",
                  lambda m: flags[m.group(1)] if "_" in m.group(1) else m.group(1), message)


# -- argparse types: a message that names the value ---------------------------------------------

def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, with a message naming the value otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be {low} or more")
        return value
    # The rule in words, for `check_values`: a value given in Python was never typed text.
    parse.rule = "a positive integer" if low == 1 else f"an integer, {low} or more"
    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0, with a message naming the value otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # nan and inf too: "nan >= 0" is False
        raise argparse.ArgumentTypeError(f"{text} is not allowed: it must be a finite number, "
                                         "0 or more")
    return value


non_negative_float.rule = "a finite number, 0 or more"
