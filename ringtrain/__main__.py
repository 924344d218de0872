"""`python -m ringtrain ...`: how `ringtrain train` relaunches itself on each worker
(`ringtrain.cli.run_and_end`: a launched worker ends without interpreter shutdown)."""

from ringtrain.cli import run_and_end

run_and_end()
