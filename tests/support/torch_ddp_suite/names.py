"""Which tests of the installed torch's distributed_test.py are DDP tests (read, not imported).

A test of `DistributedTest._DistTestBase` is a DDP test when its name mentions DDP
(`ddp`, `DistributedDataParallel`), when it builds one (a call to `DistributedDataParallel`
in its body or in a method of the class it calls through `self.`, transitively), or when it
is gated on the backend supporting DDP (`DistTestCases.backend_feature["ddp"]`). On torch 2.13
that is 104 tests (issue 25's count). Parsed with `ast`: importing the module would bind its
skip decorators before the retargeting patches them, and costs ~4 s.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
_NAMED = re.compile(r"ddp|distributeddataparallel", re.I)


def suite_path() -> Path:
    spec = importlib.util.find_spec(SUITE_MODULE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{SUITE_MODULE} is not in this torch install")
    return Path(spec.origin)


def _test_base(tree: ast.Module) -> ast.ClassDef:
    for outer in tree.body:
        if isinstance(outer, ast.ClassDef) and outer.name == "DistributedTest":
            for inner in outer.body:
                if isinstance(inner, ast.ClassDef) and inner.name == "_DistTestBase":
                    return inner
    raise LookupError("no class DistributedTest._DistTestBase in distributed_test.py: "
                      "torch's layout changed; update tests/support/torch_ddp_suite/names.py")


def _builds_ddp(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "DistributedDataParallel":
                return True
    return False


def _self_calls(fn: ast.FunctionDef) -> set[str]:
    return {node.attr for node in ast.walk(fn) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def _gated_on_ddp(fn: ast.FunctionDef) -> bool:
    return any(re.search(r"""backend_feature\[["']ddp["']\]""", ast.unparse(d))
               for d in fn.decorator_list)


@cache
def ddp_test_names(path: Path | None = None) -> tuple[str, ...]:
    """The DDP tests of `path` (the installed torch's distributed_test.py), sorted."""
    tree = ast.parse((path or suite_path()).read_text())
    methods = {f.name: f for f in _test_base(tree).body if isinstance(f, ast.FunctionDef)}
    builders = {n for n, f in methods.items() if _builds_ddp(f)}
    calls = {n: _self_calls(f) for n, f in methods.items()}
    grew = True
    while grew:  # a method that calls a builder builds one too
        grown = {n for n in methods if n not in builders and calls[n] & builders}
        builders |= grown
        grew = bool(grown)
    return tuple(sorted(n for n, f in methods.items() if n.startswith("test_") and (
        _NAMED.search(n) or n in builders or _gated_on_ddp(f))))
