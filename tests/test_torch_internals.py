"""`ringtrain.torch_internals`: the one module that touches torch's private names.

    .venv/bin/pytest -q tests/test_torch_internals.py

Single-process and fast: the shim imports on this torch, fails clearly on a torch without a
name, its accessors do what the callers relied on, and no other module touches the names.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

import ringtrain.torch_internals as ti
from ringtrain.torch_internals import TESTED_TORCH, TorchInternalsError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ringtrain"

# Every private torch name (or internal attribute) the shim owns. No module of ringtrain other
# than torch_internals.py may mention one, not even in a comment: go through the shim's accessor.
# Generic attribute names the shim also checks (`envs`, `proc`) are left out: they would match
# ringtrain's own code.
PRIVATE_NAMES = [
    # backward_tls_free
    "_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls",
    # process_groups, sequence_number (ringtrain.launch.hang)
    "_world", "pg_map", "_get_sequence_number_for_group",
    # current_autograd_node, queue_backward_callback (ringtrain.ddp.reducer)
    "_current_autograd_node", "_execution_engine", "queue_callback",
    # flatten/unflatten_dense_tensors, preserve_version_counter (ringtrain.ddp.distributed)
    "_flatten_dense_tensors", "_unflatten_dense_tensors", "_unsafe_preserve_version_counter",
    # default_store (ringtrain.runtime, ringtrain.checkpoint.snapshot)
    "_get_default_store",
    # group_timeout (ringtrain.ddp.lanes)
    "_get_backend", "_distributed_c10d",
    # matches_machine_hostname, RDZV_REGISTRY (ringtrain.launch.rendezvous)
    "_matches_machine_hostname", "rdzv_registry",
    # CAPTURE_PROCESS_FAILURES, running_workers, mark_finished (ringtrain.launch.launcher)
    "_capture_process_failures", "_running_local_ranks", "subprocess_handlers",
    # START_WORKERS, RESTART_WORKERS, set_remaining_restarts (ringtrain.launch.launcher)
    "_start_workers", "_restart_workers", "_remaining_restarts",
    # BatchNorm (ringtrain.pipeline.engine)
    "_BatchNorm",
]
# Spelled with their owner: the bare attribute is too common a word.
PRIVATE_PATTERNS = [r"torch\._utils\b", r"options\._timeout\b", r"distributed_c10d\._"]


def test_the_shim_imports_on_this_torch_and_names_the_torch_it_was_checked_against():
    assert torch.__version__.split("+")[0] == TESTED_TORCH
    for name in ["backward_tls_free", "process_groups", "sequence_number", "current_autograd_node",
                 "queue_backward_callback", "flatten_dense_tensors", "unflatten_dense_tensors",
                 "preserve_version_counter", "default_store", "group_timeout",
                 "matches_machine_hostname", "RDZV_REGISTRY", "CAPTURE_PROCESS_FAILURES",
                 "running_workers", "mark_finished", "BatchNorm"]:
        assert getattr(ti, name) is not None, name


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_pyproject_torch_range_is_the_one_the_shim_was_checked_against():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch>=([\d.]+),<([\d.]+)"', text)
    assert m, "pyproject.toml's dependencies must bound torch on both sides (torch>=A,<B)"
    low, high = _version(m.group(1)), _version(m.group(2))
    assert low <= _version(TESTED_TORCH) < high
    # No wider than one minor release: the shim is only known to hold for the one it checked.
    assert high[:2] == (low[0], low[1] + 1), f"torch range {m.group(0)} is wider than one minor"


def test_a_missing_name_fails_naming_the_torch_version_the_feature_and_the_fix():
    owner = types.SimpleNamespace(__name__="torch._C")
    with pytest.raises(TorchInternalsError) as e:
        ti._require(owner, "_gone_in_this_release", "the bucketed all-reduce (ringtrain.ddp.reducer)")
    msg = str(e.value)
    assert f"torch {torch.__version__}" in msg
    assert "torch._C._gone_in_this_release" in msg
    assert "the bucketed all-reduce (ringtrain.ddp.reducer)" in msg
    assert f"pip install torch=={TESTED_TORCH}" in msg
    assert isinstance(e.value, ImportError)  # it fails `import ringtrain`, not a later call


def test_a_missing_instance_attribute_fails_the_same_way():
    class Context:
        def __init__(self):
            self.renamed = set()

    with pytest.raises(TorchInternalsError, match=r"Context\(\)\._running_local_ranks.*tolerated"):
        ti._require_set_by_init(Context, "_running_local_ranks", "tolerated ranks")
    ti._require_set_by_init(Context, "renamed", "tolerated ranks")  # present: no error


def test_a_patch_point_restores_torchs_attribute_even_on_error():
    owner = types.SimpleNamespace(step="torch's")
    point = ti.PatchPoint(owner, "step")
    with pytest.raises(KeyError), point.replaced("ours"):
        assert point.get() == "ours"
        raise KeyError
    assert owner.step == "torch's"
    assert ti.CAPTURE_PROCESS_FAILURES.get() is ti.SubprocessContext.__dict__[
        ti.CAPTURE_PROCESS_FAILURES.name]


def test_autograd_accessors_see_the_running_backward():
    seen, called = [], []
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        seen.append(ti.current_autograd_node())
        ti.queue_backward_callback(lambda: called.append(ti.current_autograd_node()))
        return grad

    y = (x * 2).sum()
    x.register_hook(hook)
    assert ti.current_autograd_node() is None  # outside backward
    y.backward()
    assert seen and seen[0] is not None
    assert called == [None]  # ran once, at the end of the (non-nested) backward


def test_flatten_round_trip_and_version_counter():
    tensors = [torch.arange(4.0), torch.ones(2, 3)]
    flat = ti.flatten_dense_tensors(tensors)
    assert flat.shape == (10,)
    back = ti.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))
    t = torch.zeros(2)
    before = t._version
    with torch.no_grad(), ti.preserve_version_counter((t,)):
        t.add_(1)
    assert t._version == before and t.tolist() == [1.0, 1.0]


def test_group_timeout_is_none_where_the_backend_does_not_say():
    from datetime import timedelta

    def group(backend):
        def get(device):
            if backend is None:
                raise RuntimeError("no backend for cpu")
            return backend
        return types.SimpleNamespace(_get_backend=get)

    with_options = types.SimpleNamespace(options=types.SimpleNamespace(_timeout=timedelta(seconds=7)))
    assert ti.group_timeout(group(with_options)) == timedelta(seconds=7)
    assert ti.group_timeout(group(types.SimpleNamespace())) is None
    assert ti.group_timeout(group(None)) is None


def test_running_workers_and_mark_finished():
    ctx = types.SimpleNamespace(
        _running_local_ranks={1, 0}, envs={0: {"RANK": "4"}, 1: {}},
        subprocess_handlers={0: types.SimpleNamespace(proc="p0"), 1: types.SimpleNamespace(proc="p1")})
    assert ti.running_workers(ctx) == [(0, 4, "p0"), (1, -1, "p1")]
    ti.mark_finished(ctx, 0)
    assert ti.running_workers(ctx) == [(1, -1, "p1")]


def test_no_other_module_mentions_a_private_torch_name():
    patterns = [re.compile(rf"(?<![\w]){re.escape(n)}(?![\w])") for n in PRIVATE_NAMES]
    patterns += [re.compile(p) for p in PRIVATE_PATTERNS]
    shim = PACKAGE / "torch_internals.py"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == shim:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{lineno}: {p.pattern}: {line.strip()}"
                          for p in patterns if p.search(line)]
    assert not offenders, ("private torch names outside ringtrain/torch_internals.py (add an "
                           "accessor there and use it):\n" + "\n".join(offenders))
    shim_text = shim.read_text()
    assert all(name in shim_text for name in PRIVATE_NAMES)  # the list is not stale


def test_bounded_rendezvous_wraps_torchs_registry_and_puts_it_back():
    from ringtrain.launch.rendezvous import _bounded_rendezvous, _BoundedRendezvous

    inner = object()
    fake = types.SimpleNamespace(get_rendezvous_handler=lambda params: inner)
    with ti.RDZV_REGISTRY.replaced(fake):
        with _bounded_rendezvous("h:1"):
            handler = ti.RDZV_REGISTRY.get().get_rendezvous_handler(None)
            assert isinstance(handler, _BoundedRendezvous) and handler._inner is inner
        assert ti.RDZV_REGISTRY.get() is fake
