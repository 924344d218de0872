"""User mistakes, told apart from bugs: `ConfigError` and the exit code that says "explained".

    raise ConfigError("--pp 3 does not divide world_size=2; use --pp in [1, 2]")

A `ConfigError` is a mistake in the options or the inputs that only shows once the job runs
(a snapshot written with other options, a layout that needs the world size). Every rank finds
the same one, so `ringtrain train` prints its message once (rank 0), with no traceback, and
every worker exits with `USAGE_EXIT_CODE`; the launcher then adds nothing
(`ringtrain.failure_report.explained_by_workers`). Any other exception is reported as a failure,
traceback and all. It subclasses ValueError, so code that catches ValueError still does.
"""

from __future__ import annotations

USAGE_EXIT_CODE = 2  # argparse's: a usage error, already explained to the user


class ConfigError(ValueError):
    """A mistake the user fixes by changing the command line or the files it names."""
