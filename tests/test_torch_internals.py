"""`ringtrain.torch_internals`: the one package that touches torch's private names.

    .venv/bin/pytest -q tests/test_torch_internals.py

Single-process and CPU-only, and meant to pass on every torch in TESTED_TORCH (`make test-torch
TORCH_VERSION=...`): the shim imports on this torch with exactly the features off that this
version is known to lack; each private name, taken away, turns off only its own feature with
at most one warning and never fails the import; a feature that is off raises only when used;
the accessors do what their callers rely on; and no other module touches the names.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import ringtrain.torch_internals as ti
from ringtrain.torch_internals.features import resolve, set_by_init

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ringtrain"
SHIM = PACKAGE / "torch_internals"
# The shim's files that name torch's private names: all but features.py (the lookup machinery).
SHIM_FILES = [p for p in sorted(SHIM.glob("*.py")) if p.name != "features.py"]
# Its modules that look them up at import, the package first (features.py's classes stay).
SHIM_MODULES = ["ringtrain.torch_internals"] + [
    f"ringtrain.torch_internals.{p.stem}" for p in SHIM_FILES if p.stem != "__init__"]
MINOR = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# Every private torch name (or internal attribute) the shim owns. No module of ringtrain other
# than the shim may mention one, not even in a comment: go through the shim's accessor.
PRIVATE_NAMES = [
    "_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls",
    "_world", "pg_map", "_get_sequence_number_for_group",
    "_current_autograd_node", "_execution_engine", "queue_callback",
    "_flatten_dense_tensors", "_unflatten_dense_tensors", "_unsafe_preserve_version_counter",
    "_get_default_store", "_get_backend", "_distributed_c10d", "_matches_machine_hostname",
    "rdzv_registry", "_capture_process_failures", "_running_local_ranks", "subprocess_handlers",
    "_start_workers", "_restart_workers", "_remaining_restarts", "_BatchNorm", "_backward_hooks",
    "_popen", "_stdout", "_stderr", "_monitor_workers", "_pcontext", "_exit_barrier",
    "_foreach_copy_", "_BaseDataLoaderIter", "_num_yielded", "_index_sampler", "_in_order",
]
# Spelled with their owner: the bare attribute is too common a word.
PRIVATE_PATTERNS = [r"torch\._utils\b", r"options\._timeout\b", r"distributed_c10d\._"]
# Looked up too, but public or too generic to ban by name (ringtrain's own code uses them).
GENERIC_NAMES = {"_timeout", "envs", "proc", "ProcessGroup", "Variable", "Backend", "Options",
                 "SubprocessContext", "SubprocessHandler", "LocalElasticAgent",
                 "SimpleElasticAgent", "api", "utils"}

# What each tested torch lacks: {minor: names}. Anything else missing there is a regression.
KNOWN_MISSING = {(2, 11): {"torch._C._remove_obj_from_tls"},
                 (2, 12): {"torch._C._remove_obj_from_tls"},
                 (2, 13): set(), (2, 14): set(), (2, 15): set()}

ALL_NAMES = [(f.what, path) for f in ti.FEATURES for path in f.names]


def _off_here() -> set[str]:
    return {path for f in ti.FEATURES for path in f.missing}


def _fresh_shim() -> tuple[types.ModuleType, list[warnings.WarningMessage]]:
    """The shim's package imported again, as new modules (every name looked up on torch as it
    is now), with the warnings it gave; the modules in use are put back after."""
    import ringtrain

    saved = {name: sys.modules.pop(name) for name in SHIM_MODULES if name in sys.modules}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module("ringtrain.torch_internals")
    finally:
        for name in SHIM_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        ringtrain.torch_internals = ti  # the import set the package's attribute to the new one
    return module, [w for w in caught if issubclass(w.category, ti.TorchFeatureWarning)]


Py_TPFLAGS_IMMUTABLETYPE = 1 << 8  # CPython's flag (3.10+): its attributes cannot be set


def _take_away(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `path` missing from torch until the test ends, as a torch without it would be."""
    parent, name = path.rsplit(".", 1)
    owner = resolve(parent)
    if isinstance(resolve(path), types.ModuleType):
        monkeypatch.setitem(sys.modules, path, None)  # importing it now fails
        monkeypatch.delattr(owner, name)
        return
    holders = [owner] if isinstance(owner, types.ModuleType) else (
        owner if isinstance(owner, type) else type(owner)).__mro__
    holder = next(h for h in holders if name in vars(h))
    # An immutable C type cannot lose an attribute: replace its owner with one that lacks it.
    # Asked before trying, not caught after: pytest before 9.2 records the undo before it
    # deletes, so a failed delattr left a teardown that tried to set the attribute back.
    if isinstance(holder, type) and holder.__flags__ & Py_TPFLAGS_IMMUTABLETYPE:
        grand, owner_name = parent.rsplit(".", 1)
        monkeypatch.setattr(resolve(grand), owner_name, types.SimpleNamespace())
    else:
        monkeypatch.delattr(holder, name)


def test_the_shim_imports_on_a_tested_torch_with_only_the_known_features_off():
    bounds = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", ti.TORCH_RANGE).groups()
    low, high = tuple(map(int, bounds[:2])), tuple(map(int, bounds[2:]))
    assert low <= MINOR < high, (torch.__version__, ti.TORCH_RANGE)
    if MINOR in KNOWN_MISSING:
        assert _off_here() == KNOWN_MISSING[MINOR], f"torch {torch.__version__}"
    for name in ["backward_tls_free", "process_groups", "sequence_number", "current_autograd_node",
                 "queue_backward_callback", "flatten_dense_tensors", "unflatten_dense_tensors",
                 "preserve_version_counter", "default_store", "group_timeout",
                 "matches_machine_hostname", "RDZV_REGISTRY", "CAPTURE_PROCESS_FAILURES",
                 "START_WORKERS", "RESTART_WORKERS", "running_workers", "mark_finished",
                 "set_remaining_restarts", "BatchNorm"]:
        assert getattr(ti, name) is not None, name


def test_pyproject_torch_range_is_the_range_the_suite_ran_on():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch(>=[\d.]+,<[\d.]+)"', text)
    assert m, "pyproject.toml's dependencies must bound torch on both sides (torch>=A,<B)"
    assert m.group(1) == ti.TORCH_RANGE
    minors = sorted(tuple(int(p) for p in v.split(".")[:2]) for v in ti.TESTED_TORCH)
    low, high = (tuple(int(p) for p in b.split(".")) for b in re.findall(r"[\d.]+", m.group(1)))
    # From the first minor the suite passed on to the last: no wider than what a job has run.
    assert low == minors[0] and high == (minors[-1][0], minors[-1][1] + 1), (m.group(1), minors)
    assert set(KNOWN_MISSING) == set(minors)  # each tested version says what it lacks


@pytest.mark.parametrize(("what", "path"), [(w, p) for w, p in ALL_NAMES if "()" not in p],
                         ids=[p for _, p in ALL_NAMES if "()" not in p])
def test_a_missing_name_turns_off_only_its_feature_with_at_most_one_warning(what, path,
                                                                         monkeypatch):
    if path in _off_here():
        pytest.skip(f"torch {torch.__version__} already lacks {path}")
    _take_away(path, monkeypatch)
    shim, caught = _fresh_shim()  # the import goes through
    off = [f for f in shim.FEATURES if not f.on]
    assert [f.what for f in off if set(f.missing) - _off_here()] == [what]
    feature = next(f for f in off if f.what == what)
    assert any(m.startswith(path) for m in feature.missing)
    # One warning, now, naming this torch and what is lost; none where a public equivalent
    # stands in, and none yet for the TLS guard (said when there is something to lift).
    said = [str(w.message) for w in caught
            if feature.when_off and feature.when_off in str(w.message)]
    announced_at_import = feature.when_off is not None and "backward_tls_free" not in what
    assert len(said) == int(announced_at_import), said
    if said:
        assert said[0].startswith(f"torch {torch.__version__}: ") and path in said[0]


def test_a_feature_that_is_off_raises_only_when_used_naming_torch_and_the_fix(monkeypatch):
    _take_away("torch._C._current_autograd_node", monkeypatch)
    shim, _ = _fresh_shim()
    with pytest.raises(ti.TorchInternalsError) as e:
        shim.queue_backward_callback(lambda: None)
    msg = str(e.value)
    assert f"torch {torch.__version__}" in msg and "torch._C._current_autograd_node" in msg
    assert "gradient sync" in msg and f"pip install 'torch{ti.TORCH_RANGE}'" in msg
    assert shim.flatten_dense_tensors([torch.ones(2)]).tolist() == [1.0, 1.0]  # the rest works


def test_without_torchs_helpers_the_fallbacks_still_work(monkeypatch):
    for name in ["_flatten_dense_tensors", "_unflatten_dense_tensors", "_BatchNorm",
                 "_unsafe_preserve_version_counter"]:
        _take_away(next(p for _, p in ALL_NAMES if p.endswith("." + name)), monkeypatch)
    shim, caught = _fresh_shim()
    tensors = [torch.arange(4.0), torch.ones(2, 3)]
    back = shim.unflatten_dense_tensors(shim.flatten_dense_tensors(tensors), tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))
    assert isinstance(torch.nn.LazyBatchNorm2d(), shim.BatchNorm)
    assert not isinstance(torch.nn.LayerNorm(3), shim.BatchNorm)
    t = torch.zeros(2)
    with torch.no_grad(), shim.preserve_version_counter((t,)):  # off: a plain no-op
        t.add_(1)
    assert t.tolist() == [1.0, 1.0]
    assert len(caught) == 1 and "version counters" in str(caught[0].message)


def _backward_through(shim: types.ModuleType) -> list[bool]:
    """Run a backward whose hook enters `shim.backward_tls_free` twice; what the TLS held inside."""
    inside = []

    def hook(grad):
        for _ in range(2):
            with shim.backward_tls_free():
                inside.append(torch._C._is_key_in_tls("context"))
        return grad

    x = torch.ones(3, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()
    return inside


def test_backward_tls_free_leaves_no_context_in_tls_on_this_torch():
    # 2.13 and later stash one for the whole of backward and the shim lifts it; 2.11 stashes
    # none; 2.12 stashes one it cannot erase (no _remove_obj_from_tls): there it stays, and the
    # exit handler covers the race (torch_internals/autograd.py says how that was measured).
    stays = MINOR == (2, 12)
    assert _backward_through(ti) == [stays, stays]


def test_a_torch_that_cannot_lift_the_context_is_a_silent_no_op():
    """It warned once per process, on 2.12 on every run, about an abort at exit that 60
    launches under load never showed (the exit handler stands in)."""
    stashes = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: stashes.append(torch._C._is_key_in_tls("context")) or g)
    x.sum().backward()
    shim, caught = _fresh_shim()
    assert [str(w.message) for w in caught] == []
    # As 2.11 and 2.12 are (taking the name from torch itself would break the backward of 2.13
    # and later, which call it).
    shim._TLS.missing[:] = ["torch._C._remove_obj_from_tls"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside = _backward_through(shim)
    assert inside == stashes * 2  # a no-op: the context, if any, stays
    assert [w for w in caught if issubclass(w.category, ti.TorchFeatureWarning)] == []


def test_import_ringtrain_succeeds_without_names_and_says_so_once():
    # The whole package, in a fresh interpreter, on a torch stripped of two names.
    code = ("import torch, warnings; warnings.simplefilter('always'); "
            "del torch._C._current_autograd_node; del torch._utils._flatten_dense_tensors; "
            "import ringtrain, ringtrain.ddp, ringtrain.launch.launcher, "
            "ringtrain.torch_internals as ti; "
            "print(sorted(f.what.split(' (')[0] for f in ti.FEATURES if not f.on))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if "TorchFeatureWarning" in ln]
    assert len(lines) == 1 and "cannot sync gradients" in lines[0], run.stderr
    assert "broadcasting parameters and buffers in a few flat chunks" in run.stdout


def test_set_by_init_sees_a_renamed_instance_attribute():
    class Context:
        def __init__(self):
            self.renamed = set()

    feature = ti.Feature("tolerated ranks", "tolerate_ranks is unavailable")
    set_by_init(Context, "renamed", feature)
    assert feature.on
    set_by_init(Context, "_running_local_ranks", feature)
    assert not feature.on
    assert feature.missing[0].endswith("Context()._running_local_ranks (set by its constructor)")


def test_a_patch_point_restores_torchs_attribute_even_on_error():
    owner = types.SimpleNamespace(step="torch's")
    point = ti.PatchPoint(owner, "step")
    with pytest.raises(KeyError), point.replaced("ours"):
        assert point.get() == "ours"
        raise KeyError
    assert owner.step == "torch's"
    capture = ti.CAPTURE_PROCESS_FAILURES
    assert capture.get() is capture.owner.__dict__[capture.name]


def test_a_patch_point_of_a_feature_that_is_off_keeps_torchs_or_raises():
    owner = types.SimpleNamespace(step="torch's")
    off = ti.Feature("restarts counted for the job", "each node counts its own", missing=["x._y"])
    kept = ti.PatchPoint(owner, "step", off)
    assert kept.get() is None
    with kept.replaced("ours"):
        assert owner.step == "torch's"
    strict = ti.PatchPoint(owner, "step", off, raise_when_off=True)
    with pytest.raises(ti.TorchInternalsError, match=r"restarts counted for the job needs x\._y"):
        strict.get()


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

    with_options = types.SimpleNamespace(
        options=types.SimpleNamespace(_timeout=timedelta(seconds=7))
    )
    assert ti.group_timeout(group(with_options)) == timedelta(seconds=7)
    assert ti.group_timeout(group(types.SimpleNamespace())) is None
    assert ti.group_timeout(group(None)) is None


def test_running_workers_and_mark_finished():
    ctx = types.SimpleNamespace(
        _running_local_ranks={1, 0}, envs={0: {"RANK": "4"}, 1: {}},
        subprocess_handlers={0: types.SimpleNamespace(proc="p0"),
                             1: types.SimpleNamespace(proc="p1")})
    assert ti.running_workers(ctx) == [(0, 4, "p0"), (1, -1, "p1")]
    ti.mark_finished(ctx, 0)
    assert ti.running_workers(ctx) == [(1, -1, "p1")]


def test_no_other_module_mentions_a_private_torch_name():
    patterns = [re.compile(rf"(?<![\w]){re.escape(n)}(?![\w])") for n in PRIVATE_NAMES]
    patterns += [re.compile(p) for p in PRIVATE_PATTERNS]
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in SHIM_FILES:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{lineno}: {p.pattern}: {line.strip()}"
                          for p in patterns if p.search(line)]
    assert not offenders, ("private torch names outside ringtrain/torch_internals/ (add an "
                           "accessor there and use it):\n" + "\n".join(offenders))
    shim_text = "".join(p.read_text() for p in SHIM_FILES)
    assert all(name in shim_text for name in PRIVATE_NAMES)  # the list is not stale
    looked_up = {re.sub(r"\(\)$", "", p.split(" ")[0].rsplit(".", 1)[-1]) for _, p in ALL_NAMES}
    assert looked_up - set(PRIVATE_NAMES) - GENERIC_NAMES - {"torch", "nn"} == set()


def test_bounded_rendezvous_wraps_torchs_registry_and_puts_it_back():
    from ringtrain.launch.rendezvous import _bounded_rendezvous, _BoundedRendezvous

    inner = object()
    fake = types.SimpleNamespace(get_rendezvous_handler=lambda params: inner)
    with ti.RDZV_REGISTRY.replaced(fake):
        with _bounded_rendezvous("h:1"):
            handler = ti.RDZV_REGISTRY.get().get_rendezvous_handler(None)
            assert isinstance(handler, _BoundedRendezvous) and handler._inner is inner
        assert ti.RDZV_REGISTRY.get() is fake
