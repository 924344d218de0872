"""Options defined once: a dataclass field holds a `ringtrain train` option's name, type,
default, help and checks, and everything else is generated from it.

Read `fields.py` first (`option()`, the field's metadata, and the small argparse generator),
then `recipes/` (named override files: `ringtrain train --recipe shakespeare_char`). The option
classes themselves live next to their users: `training.TrainerConfig` (the loop), each
strategy's `Config` in its own module, and `cli/options.py` (launch, data, model, run), which
puts them into one tree.

Why not tyro or jsonargparse: no new dependency for ~60 flags, and the flag names, the
`--bias/--no-bias` pair and the strategies' shared flags stay exactly as they were.

Imports nothing of ringtrain's: every layer may declare options.
"""

from ringtrain.config.fields import (
    MUST_MATCH,
    SCHEDULE,
    add_section,
    check_values,
    dest,
    flag,
    int_at_least,
    non_negative_float,
    option,
    option_fields,
    resume_fields,
    schedule_fields,
    set_values,
    to_flags,
)

__all__ = ["MUST_MATCH", "SCHEDULE", "add_section", "check_values", "dest", "flag",
           "int_at_least", "non_negative_float", "option", "option_fields", "resume_fields",
           "schedule_fields", "set_values", "to_flags"]

