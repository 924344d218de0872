"""A one-process run communicates nothing, so it reports exactly 0 communication (issue 15):
in metrics.jsonl, summary.json and report.png, for every strategy that runs on one process.

    .venv/bin/pytest -q tests/test_report.py
"""

import pytest
import torch
from torch.utils.data import Subset

from ringtrain.data.addition import AdditionDataset
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.strategies import make_strategy
from ringtrain.training.report import write_report
from ringtrain.training.trainer import Trainer, TrainerConfig

MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    destroy_distributed()


# DDP was the one seen (report.png drew ~0.36 ms of "communication wait" per step: the time from
# the last gradient to the end of backward, which on one rank is the reducer's copies); local SGD
# timed its (empty) meeting and the pipeline its gradient clipping as communication.
@pytest.mark.parametrize("name,options", [("ddp", {}), ("localsgd", {"sync_every": 2}),
                                          ("diloco", {}), ("zero", {}), ("pipeline", {"pp": 1})])
def test_a_one_process_run_reports_zero_communication(name, options):
    rt = init_distributed()
    assert rt.world_size == 1
    cfg = TrainerConfig(steps=4, batch_size=8, lr=3e-3, progress=False, log_every=1,
                        eval_batch_size=4)
    trainer = Trainer(make_strategy(name, runtime=rt, **options), rt, lambda: GPT(MODEL),
                      AdditionDataset("train", 1), Subset(AdditionDataset("test", 1), range(4)),
                      loss_fn, cfg)
    summary = trainer.fit()
    records = trainer.metrics.records
    assert [r["comm_s"] for r in records] == [0.0] * 4 and summary["comm_s_per_step"] == 0.0
    assert all(r["compute_s"] > 0 for r in records)  # the time went to compute instead


def test_the_report_says_there_was_no_communication(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    real = matplotlib.axes.Axes.stackplot

    def stackplot(self, *args, **kwargs):  # records the legend's labels, then draws
        labels.extend(kwargs.get("labels", ()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "stackplot", stackplot)
    records = [{"step": s, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "compute_s": 0.01,
                "comm_s": 0.0} for s in (1, 2)]
    write_report(records, str(tmp_path / "report.png"))
    assert labels == ["compute", "communication wait: none"]
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_no_report_writes_summary_json_and_draws_no_report_png(tmp_path, monkeypatch):
    """`--no-report` (TrainerConfig.report): the run's files less report.png; matplotlib is
    ~1 s of CPU on rank 0 of every launch the suite starts."""
    from ringtrain.cli.train_args import parse_options
    from ringtrain.training.summary import write_run_files

    assert parse_options(["--no-report"]).trainer.report is False
    assert parse_options([]).trainer.report is True
    drawn: list[str] = []
    monkeypatch.setattr("ringtrain.training.report.write_report",
                        lambda records, path, title="": drawn.append(path))
    for report, run_dir in ((False, tmp_path / "off"), (True, tmp_path / "on")):
        run_dir.mkdir()
        assert write_run_files(str(run_dir), {"steps": 1}, [], title="t", saved_step=None,
                               report=report) is None
        assert (run_dir / "summary.json").is_file()
    assert drawn == [str(tmp_path / "on" / "report.png")]
    # The summary's last line names the files that are there, not report.png where none is.
    from ringtrain.training.progress import format_summary

    off = str(tmp_path / "off")
    assert format_summary({"run_dir": off}).endswith(f"run directory: {off} (summary.json)")
