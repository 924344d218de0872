"""Bad input at every user-facing entry point: a clear error naming the value and the fix, an
exit within seconds, nothing left running, no snapshot lost.

    .venv/bin/pytest -q tests/test_bad_input.py

One table per entry point: `ringtrain train`'s options and `--data` (run in this process with
the launcher replaced, so nothing trains by mistake), `ringtrain run`'s flags, snapshots on
disk (truncated, not a snapshot, saved with other options: one real single-process run makes
them), and the library's constructors. tests/test_errors.py holds the cases it already had
(unknown flags, strategy layouts, batch sizes); this file does not repeat them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ringtrain.cli.train import main as train_main
from ringtrain.launch.launcher import main as run_main
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.runtime import get_runtime

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--batch-size", "8", "--no-progress",
        "--threads", "1", "--no-report"]
FAST_S = 10.0  # "within seconds" on a busy 2-core machine


def _children() -> list[int]:
    """This process's live children (a launched job would show up here)."""
    me, out = str(os.getpid()), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.append(int(d.name))
    return out


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RINGTRAIN_STARTED_AT", str(time.time()))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    before = set(_children())
    yield
    torch.set_num_threads(threads)
    destroy_distributed()
    assert set(_children()) <= before, "a process was left running"


def _no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the job started: the mistake was not caught before launch")
    monkeypatch.setattr("ringtrain.launch.launcher.launch", refuse)
    monkeypatch.setattr("ringtrain.cli.train.run_job", refuse)


def _one_error(capsys, prog: str) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("usage:")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


def _argv_id(x):
    # The test id is the command line; pytest numbers the regexes.
    return " ".join(x) if isinstance(x, list) else None


# ---- ringtrain train: options and --data --------------------------------------------------------

def _files(tmp: Path) -> dict[str, str]:
    (tmp / "empty.txt").write_text("")
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (tmp / "a_dir").mkdir()
    (tmp / "corpus").mkdir()  # text files, not prepared
    (tmp / "corpus" / "a.txt").write_text("some text\n")
    (tmp / "dataset").mkdir()  # `ringtrain prepare`'s (what --run-dir reads of it)
    (tmp / "dataset" / "meta.json").write_text('{"format": "ringtrain-tokens"}')
    (tmp / "gpt2_dir").mkdir()  # `ringtrain export --format hf`'s
    (tmp / "gpt2_dir" / "config.json").write_text('{"model_type": "gpt2"}')
    return {"EMPTY": str(tmp / "empty.txt"), "BINARY": str(tmp / "binary.txt"),
            "DIR": str(tmp / "a_dir"), "CORPUS": str(tmp / "corpus"),
            "DATASET": str(tmp / "dataset"), "EXPORT": str(tmp / "gpt2_dir")}


TRAIN_CASES = [  # argv, the value named, the fix offered (regexes)
    (["--lr", "nan"], r"--lr: nan", r"a finite number"),
    (["--lr", "inf"], r"--lr: inf", r"a finite number"),
    (["--min-lr", "1"], r"--min-lr 1\.0 is above the peak lr \(0\.003\)", r"lower --min-lr"),
    (["--stop-at-accuracy", "2"], r"--stop-at-accuracy 2\.0", r"in \(0, 1\], e\.g\. 0\.99"),
    (["--nnodes", "x"], r"--nnodes x", r"the number of machines \(2\) or a range MIN:MAX"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400", "--run-dir", "r"],
     r"--node-rank 2 is not below --nnodes 2", r"number the machines 0\.\.1"),
    (["--nnodes", "2", "--rdzv-endpoint", "nocolon", "--run-dir", "r"], r"--rdzv-endpoint nocolon",
     r"HOST:PORT, e\.g\. 10\.0\.0\.1:29400"),
    (["--digits", "9"], r"--digits 9", r"supports 1\.\.3"),
    (["--data", "EMPTY"], r"--data \S*empty\.txt: 0 characters",
     r"use a longer text or a smaller --block-size"),
    (["--data", "BINARY"], r"--data \S*binary\.txt: not UTF-8", r"convert it to UTF-8"),
    (["--data", "DIR"], r"--data \S*a_dir: a directory without meta\.json", r"ringtrain prepare"),
    (["--data", "CORPUS"], r"--data \S*corpus: a folder of text, not a prepared token dataset",
     r"`ringtrain prepare \S*corpus \S*corpus_tokens`, then --data \S*corpus_tokens"),
    (["--data", "/no/such.txt"], r"--data /no/such\.txt: no such file", r"give the path"),
    (["--run-dir", "/proc/ringtrain-x"], r"--run-dir /proc/ringtrain-x",
     r"choose a directory you can write"),
    (["--data", "EXPORT"], r"--data \S*gpt2_dir holds an hf export, not a dataset",
     r"--init-from \S*gpt2_dir starts from its model; --data takes a prepared dataset"),
    (["--run-dir", "DATASET"], r"--run-dir \S*dataset is a prepared dataset \(meta\.json",
     r"a directory of its own \(and this one as --data \S*dataset\)"),
    (["--run-dir", "EXPORT"], r"--run-dir \S*gpt2_dir holds an hf export, not a run: a run would "
     r"write its config\.json and model\.safetensors over it", r"--init-from \S*gpt2_dir starts"),
    (["--run-dir", "r", "--init-from", "r/"], r"--init-from r/ is --run-dir itself",
     r"drop --init-from to resume that run, or .* another --run-dir \(--init-from r/ --run-dir "
     r"NEW\)"),
]


@pytest.mark.parametrize("argv, value, fix", TRAIN_CASES, ids=_argv_id)
def test_ringtrain_train_names_the_value_and_the_fix(
    argv, value, fix, capsys, monkeypatch, tmp_path
):
    _no_launch(monkeypatch)
    files = _files(tmp_path)
    argv = [files.get(a, a) for a in argv]
    started = time.monotonic()
    assert train_main([*TINY, *argv]) == 2
    assert time.monotonic() - started < FAST_S
    line = _one_error(capsys, "ringtrain train")
    assert re.search(value, line) and re.search(fix, line), line
    assert not os.path.exists("runs")


def test_a_warmup_longer_than_the_run_is_a_warning(capsys, monkeypatch):
    launched = []
    monkeypatch.setattr("ringtrain.cli.train.run_job", lambda *a, **k: launched.append(1) or 0)
    assert train_main([*TINY, "--steps", "10", "--warmup-steps", "50", "--run-dir", "r"]) == 0
    err = capsys.readouterr().err
    assert launched
    assert "--warmup-steps 50 is more than --steps 10" in err and "lower --warmup-steps" in err


# ---- ringtrain run ------------------------------------------------------------------------------

RUN_CASES = [
    (["--nproc-per-node", "0", "SCRIPT"], r"--nproc-per-node 0: start at least one worker"),
    (["--nproc-per-node", "two", "SCRIPT"], r"--nproc-per-node two: .*or auto \(one per GPU, "
                                            r"else one per CPU core\), gpu or cpu"),
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:29400", "SCRIPT"],
     r"--node-rank 5 is not below --nnodes 2: number the nodes 0\.\.1"),
    (["--nnodes", "2", "--rdzv-endpoint", "nocolon", "SCRIPT"],
     r"--rdzv-endpoint nocolon: .*HOST:PORT"),
    (["--watchdog-timeout", "-1", "SCRIPT"], r"--watchdog-timeout -1: it must be >= 0"),
    (["--max-restarts", "-1", "SCRIPT"], r"--max-restarts -1: it must be 0 or more"),
    (["--monitor-interval", "0", "SCRIPT"], r"--monitor-interval 0: it must be above 0"),
    # (an endpoint: without one torch 2.15 warns that master_addr is for static alone)
    (["--rdzv-backend", "foo", "--rdzv-endpoint", "127.0.0.1:1", "SCRIPT"],
     r"--rdzv-backend foo: not a rendezvous backend torch knows; use c10d"),
    (["DIR"], r"training script '\S*' is a directory without a __main__\.py, which python "
             r"would run; pass the \.py file to run"),
    (["-m", "no_such_module_rt"], r"module 'no_such_module_rt' not found .*PYTHONPATH"),
    (["--cold-starts", "--master-port", "PORT", "SCRIPT"],  # held by the test: no worker starts
     r"port (\d+) \(--master-port \1\) is in use on this host by another process .*ss -ltnp "
     r".*; leave it out: on one node ringtrain run picks a free port"),
]


@pytest.mark.parametrize("argv, message", RUN_CASES, ids=_argv_id)
def test_ringtrain_run_names_the_value_and_the_fix(argv, message, capsys, tmp_path):
    (tmp_path / "s.py").write_text("print('ran')\n")
    held = socket.create_server(("0.0.0.0", 0))  # a port another program listens on
    named = {"SCRIPT": str(tmp_path / "s.py"), "DIR": str(tmp_path),
             "PORT": str(held.getsockname()[1])}
    argv = [named.get(a, a) for a in argv]
    started = time.monotonic()
    with held:
        assert run_main(argv) == 2
    assert time.monotonic() - started < FAST_S
    line = _one_error(capsys, "ringtrain run")
    assert re.search(message, line), line
    assert "ran" not in capsys.readouterr().out


# ---- snapshots on disk --------------------------------------------------------------------------

def _digests(snaps: Path) -> dict[str, str]:
    return {str(p.relative_to(snaps)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(snaps.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One single-process run of 6 steps: snapshots of steps 4 and 6 kept."""
    run = tmp_path_factory.mktemp("bad_snapshots") / "run"
    assert train_main([*TINY, "--steps", "6", "--snapshot-every", "2", "--eval-every", "6",
                       "--run-dir", str(run)]) == 0
    destroy_distributed()
    return run


def _truncate(snaps: Path) -> str:
    p = snaps / "snap-00000006" / "shared.pt"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _not_a_snapshot(snaps: Path) -> str:
    stray = snaps / "snap-00000099"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a snapshot")


def _garbage_manifest(snaps: Path) -> str:
    (snaps / "snap-00000006" / "manifest.json").write_text("{ not json")


SNAPSHOT_CASES = [  # damage, extra options, exit code, what is said, the step resumed from
    (_truncate, [], 0, r"snap-00000006/shared\.pt: sha256 .* was committed", 4),
    (_not_a_snapshot, [], 0, r"snap-00000099 has no COMMITTED marker", 6),
    (_garbage_manifest, [], 0, r"snap-00000006/manifest\.json: sha256 differs", 4),
    (None, ["--lr", "0.01"], 2, r"--lr 0\.003 in the snapshot, 0\.01 now.*--no-resume", None),
    (None, ["--seed", "7"], 2, r"--seed 1337 in the snapshot, 7 now.*another --run-dir", None),
]


@pytest.mark.parametrize("damage, extra, code, said, resumed", SNAPSHOT_CASES)
def test_a_bad_snapshot_is_named_and_no_good_one_is_lost(saved, tmp_path, capsys, damage, extra,
                                                          code, said, resumed):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    snaps = run / "snapshots"
    if damage is not None:
        damage(snaps)
    before = _digests(snaps)
    capsys.readouterr()
    started = time.monotonic()
    assert train_main([*TINY, "--steps", "6", "--snapshot-every", "2", "--eval-every", "6",
                       "--run-dir", str(run), *extra]) == code
    assert time.monotonic() - started < 6 * FAST_S
    err = capsys.readouterr().err
    assert re.search(said, err), err
    if code != 0:  # refused: every file of every snapshot is as it was
        assert _digests(snaps) == before
    else:
        import json

        assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == [resumed]


# ---- the library's constructors -----------------------------------------------------------------

@pytest.fixture()
def one_process():
    threads = torch.get_num_threads()
    rt = init_distributed()
    yield rt
    torch.set_num_threads(threads)
    destroy_distributed()


def _ddp(**kw):
    from ringtrain.ddp.distributed import DistributedDataParallel

    return lambda: DistributedDataParallel(**kw)


def _sampler(*args, **kw):
    from ringtrain.data.sampler import DistributedSampler

    return lambda: DistributedSampler(*args, **kw)


def _sampler_load(state):
    from ringtrain.data.sampler import DistributedSampler

    return lambda: DistributedSampler(
        list(range(10)), num_replicas=1, rank=0
    ).load_state_dict(state)


def _zero(*args, **kw):
    from ringtrain.zero.sharded import ZeroDataParallel

    return lambda: ZeroDataParallel(*args, **kw)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _snapshots(root="snaps", **kw):
    from ringtrain.checkpoint.snapshot import SnapshotManager

    return lambda: SnapshotManager(root, **kw)


def _check_replicas(model):
    from ringtrain.replicas import check_replicas

    return lambda: check_replicas(model)


def _make_strategy(name, **options):
    from ringtrain.strategies import make_strategy

    return make_strategy(name, **options)


def _collate(dataset, indices):
    from ringtrain.training.evaluate import collate

    return collate(dataset, indices)


def _per_sample_sum(*args):
    from ringtrain.training.evaluate import per_sample_sum

    return per_sample_sum(*args)


def _checked_eval_set(*args):  # was an eval_loss of NaN at every evaluation
    from ringtrain.training.evaluate import checked_eval_set

    return checked_eval_set(*args)


def _config(**kw):
    from ringtrain.training.config import TrainerConfig

    return lambda: TrainerConfig(**kw).resolved()


CONSTRUCTOR_CASES = [  # id, call, error type, message (value and fix)
    ("ddp bucket_cap_mb", _ddp(module=nn.Linear(2, 2), bucket_cap_mb=-1), ValueError,
     r"bucket_cap_mb=-1: it must be positive \(default 25\)"),
    ("ddp comm_lanes", _ddp(module=nn.Linear(2, 2), comm_lanes=0), ValueError,
     r"comm_lanes=0: .* >= 1"),
    ("ddp no parameters", _ddp(module=nn.ReLU()), ValueError,
     r"ReLU has none\); use the module as is"),
    ("ddp device_ids on cpu", _ddp(module=nn.Linear(2, 2), device_ids=[3]), ValueError,
     r"device_ids=\[3\] .* pass device_ids=None"),
    ("sampler rank", _sampler(list(range(10)), num_replicas=2, rank=5), ValueError,
     r"Invalid rank 5, rank should be in the interval \[0, 1\]"),
    ("sampler replicas", _sampler(list(range(10)), num_replicas=0, rank=0), ValueError,
     r"num_replicas=0: it must be at least 1"),
    ("sampler no len", _sampler(iter(range(3)), num_replicas=1, rank=0), TypeError,
     r"needs a dataset with __len__ .*got range_iterator; wrap an iterable in a list"),
    ("sampler exact+drop_last",
     _sampler(list(range(3)), num_replicas=1, rank=0, exact=True, drop_last=True), ValueError,
     r"contradict.*pass one of them"),
    ("sampler state", _sampler_load({"x": 1}), ValueError,
     r"not a DistributedSampler state: keys .*'dataset_len'.*"
     r" pass what sampler\.state_dict\(\) returned"),
    ("zero stage", _zero(nn.Linear(2, 2), _sgd, stage=4), ValueError,
     r"stage=4: .*use 1 .*, 2 .* or 3"),
    ("snapshots keep", _snapshots(rank=0, world_size=1, keep=0), ValueError,
     r"keep=0: keep at least 1"),
    ("snapshots rank", _snapshots(rank=3, world_size=2), ValueError, r"Invalid rank 3"),
    ("snapshots root None", _snapshots(None), TypeError,
     r"SnapshotManager\(root_dir=None\): give the directory .* a str or Path"),
    # world size 1 compares nothing; a wrong argument is still said (it returned None)
    ("check_replicas int", _check_replicas(3), TypeError,
     r"a module, a DDP wrapper or a state dict, not int: pass the model"),
    ("check_replicas not tensors", _check_replicas({"w": torch.ones(2), "step": 3}), TypeError,
     r"other values \(\{'step': 'int'\}\): pass the model"),
    ("trainer steps", _config(steps=0), ValueError, r"steps=0: it must be a positive integer"),
    # a second init_distributed returns the group that is up: arguments for another are refused
    ("init again, other group", lambda: init_distributed(backend="nccl", world_size=2),
     RuntimeError, r"init_distributed\(backend='nccl', world_size=2\): the process group is "
     r"already up with backend='gloo', world_size=1.*destroy_distributed\(\) first"),
    ("trainer min_lr", _config(lr=0.1, min_lr=0.5), ValueError,
     r"min_lr=0\.5 is above the peak lr"),
    ("ddp not a module", _ddp(module="model"), TypeError, r"'model'.*nn\.Module"),
    ("zero not a module", _zero("model", _sgd), TypeError, r"'model'.*nn\.Module"),
    ("zero optimizer_fn None", _zero(nn.Linear(2, 2), None), TypeError, r"optimizer_fn"),
    ("make_strategy option", lambda: _make_strategy("zero", stage=3), ValueError,
     r"make_strategy\('zero'\): 'stage' is not an option of the zero strategy, which takes "
     r"runtime, zero_stage"),
    ("tp strategy, not a GPT", lambda: _make_strategy("tp", runtime=get_runtime(), tp=1).setup(
        nn.Sequential(nn.Linear(2, 2)), _sgd, None), ValueError,
     r"--strategy tp --tp 1 parallelises ringtrain's GPT .*'embed\.wte' matches no module of "
     r"Sequential.*your own plan .*parallelize\(model, .* or use a strategy that takes any model"),
    ("pipeline stages over layers", lambda: _make_strategy(
        "pipeline", runtime=get_runtime(), pp=1, schedule="zb-v").setup(
        nn.Sequential(nn.Linear(2, 2)), _sgd, nn.functional.mse_loss), ValueError,
     r"--pp 1 with 2 model chunks per rank \(--schedule zb-v\) makes 2 stages, but the model "
     r"has only 1 layer: .*Use --schedule 1f1b"),
    ("dataset of dicts", lambda: _collate([{"x": torch.zeros(2), "y": 1}], [0]), TypeError,
     r"list\[0\] is a dict with keys \['x', 'y'\]: the Trainer takes a Dataset of \(input, "
     r"target\) pairs.*return d\['x'\], d\['y'\]"),
    ("dataset of triples", lambda: _collate([(torch.zeros(2), 1, 2)], [0]), TypeError,
     r"list\[0\] is a tuple of 3: the Trainer takes"),
    ("eval metric mean", lambda: _per_sample_sum("accuracy", torch.tensor(0.5), 4), ValueError,
     r"eval_metrics\['accuracy'\] returned a tensor of shape \(\) for a batch of 4: a metric "
     r"returns one value per sample, shape \(4,\)"),
    ("eval metric pair", lambda: _per_sample_sum("acc", (torch.ones(4).sum(), 4), 4), ValueError,
     r"eval_metrics\['acc'\] returned a tuple for a batch of 4"),
    ("empty eval set", lambda: _checked_eval_set(torch.utils.data.TensorDataset(torch.ones(0))),
     ValueError, r"the evaluation set \(TensorDataset\) holds no sample; .* eval_set=None"),
]


@pytest.mark.parametrize("name, call, error, message", CONSTRUCTOR_CASES,
                         ids=[getattr(c, "values", c)[0] for c in CONSTRUCTOR_CASES])
def test_constructors_name_the_value_and_the_fix(one_process, name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_second_init_distributed_returns_the_group_it_describes(one_process):
    assert init_distributed() is one_process
    assert init_distributed(backend="gloo", device="cpu", rank=0, world_size=1) is one_process
    assert init_distributed(backend="auto", device="auto") is one_process


def test_before_init_the_constructors_say_to_call_init_distributed():
    destroy_distributed()
    with pytest.raises(RuntimeError, match=r"call ringtrain\.init_distributed\(\)"):
        _ddp(module=nn.Linear(2, 2))()
    with pytest.raises(RuntimeError, match=r"call ringtrain\.init_distributed\(\) first"):
        _sampler(list(range(4)))()
