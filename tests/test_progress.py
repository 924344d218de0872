"""The progress bar (`ringtrain.training.progress.Progress`): redrawn on a terminal, one plain
line per --log-every steps (and the last step once) anywhere else."""

import io
import re

import pytest

from ringtrain.training.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(progress: Progress, steps: int, metric_steps) -> None:
    for step in range(1, steps + 1):
        progress.update(step)
        if step in metric_steps:  # the trainer's logged steps: log_every, evaluations, the last
            progress.set_metrics(2.5, 1234.0, accuracy=0.5)
    progress.close()


def test_not_a_terminal_prints_a_line_per_log_every_and_the_last_once():
    out = io.StringIO()
    logged = set(range(10, 101, 10)) | {25, 100}  # an evaluation at 25 prints nothing extra
    _run(Progress(100, log_every=20, file=out), 100, logged)
    lines = out.getvalue().splitlines()
    assert ([int(re.match(r"train (\d+)/100 ", line).group(1)) for line in lines]
            == [20, 40, 60, 80, 100])
    assert "\r" not in out.getvalue()
    assert re.fullmatch(r"train 100/100 \(100%\) loss 2\.5000 tok/s 1,234 accuracy 0\.5 "
                        r"elapsed \d+:\d\d:\d\d eta \d+:\d\d:\d\d", lines[-1]), lines[-1]


def test_a_last_step_off_the_grid_is_printed_once_and_a_resumed_run_starts_later():
    out = io.StringIO()
    _run(Progress(45, log_every=20, initial=30, file=out), 45, {40, 45})
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["40/45", "45/45"]


def test_a_terminal_gets_the_redrawn_bar_and_rank_1_nothing():
    tty = _Terminal()
    _run(Progress(50, log_every=10, file=tty), 50, {10, 50})
    assert "\r" in tty.getvalue() and "50/50" in tty.getvalue()
    quiet = io.StringIO()
    _run(Progress(50, enabled=False, log_every=10, file=quiet), 50, {10, 50})
    assert quiet.getvalue() == ""


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_a_log_file_of_a_real_run(tmp_path, capsys, clean_env):
    """`ringtrain train` with stderr captured (not a terminal): 4 lines for 20 steps / 5."""
    from ringtrain.cli.train import main

    assert main(["--steps", "20", "--log-every", "5", "--n-layer", "1", "--n-embd", "16",
                 "--threads", "1", "--snapshot-every", "0", "--run-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train ")]
    assert [line.split()[1] for line in lines] == ["5/20", "10/20", "15/20", "20/20"], err
    assert "\r" not in err
