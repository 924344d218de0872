"""Is the thing `ringtrain run` was asked to start there? Checked before any worker starts.

    ringtrain run --nproc-per-node 2 no_such.py     # error: training script 'no_such.py' not found
    ringtrain run --nproc-per-node 2 -m no_such     # error: module 'no_such' not found
    ringtrain run --nproc-per-node 2 typo.py        # error: typo.py does not compile: ...

Without the check, N workers start, each dies of the same ImportError (or prints the same
SyntaxError), and the user reads N tracebacks and a failure report for what was a typing
mistake. A directory or a zip (a zipapp, a pex) is run by its __main__.py, which is looked for.
A script is compiled here as its workers' interpreter (this one: `ringtrain run` starts
`sys.executable`) will compile it, which runs none of it; a module is only looked up (its file is
found by its package's finders, and compiling a package's `__main__` is not worth the lookup).

A module is looked up the way the workers' `python -u -m NAME` will: in the current directory
(which `-m` puts first on sys.path), then by this interpreter's own finders (sys.meta_path: its
sys.path with PYTHONPATH, editable installs' finders, built-in modules; the workers run the same
interpreter). Only finders are asked, so no package's `__init__` runs in the launcher: a
package whose import has side effects (CUDA, a process group) stays untouched.
"""

from __future__ import annotations

import os
import sys
import traceback
import zipfile
from importlib.machinery import ModuleSpec, PathFinder


def _find_spec(fullname: str, path: list[str] | None) -> ModuleSpec | None:
    """What `import` would find for `fullname` under a parent's `path` (None: top level)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path)
        except (ImportError, ValueError, OSError):  # a finder that cannot tell: not found there
            continue
        if spec is not None:
            return spec
    return None


def module_found(name: str, cwd: str | None = None) -> bool:
    """Whether `python -m name`, started in `cwd`, would find `name` (without importing it)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return False
    spec = PathFinder.find_spec(parts[0], [cwd or os.getcwd()]) or _find_spec(parts[0], None)
    for depth in range(1, len(parts)):
        path = list(spec.submodule_search_locations or []) if spec else []
        if not path:  # not found, or a plain module: no submodules
            return False
        spec = _find_spec(".".join(parts[: depth + 1]), path)
    return spec is not None


def missing_entrypoint(script: str, module: bool, no_python: bool) -> str | None:
    """The error line for an entrypoint that is not there, or None."""
    if no_python:  # an executable on PATH or a path: the agent's own error is clear enough
        return None
    if module:
        if module_found(script):
            return None
        return (f"module {script!r} not found (in {os.getcwd()} or on sys.path); check its "
                "spelling, run from the directory that holds it, or add that directory to "
                "PYTHONPATH")
    if os.path.isdir(script) or (os.path.isfile(script) and zipfile.is_zipfile(script)):
        # `python DIR` and `python APP.pyz` (a zipapp, a pex) run the __main__.py inside
        return None if _has_main(script) else (
            f"training script {script!r} is a {'directory' if os.path.isdir(script) else 'zip'} "
            "without a __main__.py, which python would run; pass the .py file to run")
    if not os.path.isfile(script):
        return (f"training script {script!r} not found (in {os.getcwd()}); pass a path to a "
                ".py file, or -m for a module")
    return _compile_error(script)


def _has_main(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "__main__.py"))
    try:
        with zipfile.ZipFile(path) as z:
            return any(n in z.namelist() for n in ("__main__.py", "__main__.pyc"))
    except (OSError, zipfile.BadZipFile):
        return False


def _compile_error(script: str) -> str | None:
    """Python's own words for a script that does not compile (the file, line and caret), or None.

    Only a SyntaxError (IndentationError, TabError, a bad encoding) or a ValueError (null bytes)
    is the script's; a file that cannot be read is left to the workers, which say so themselves.
    """
    try:
        with open(script, "rb") as f:
            source = f.read()
    except OSError:
        return None
    try:
        compile(source, script, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        said = "".join(traceback.format_exception_only(e)).rstrip()
        return (f"training script {script!r} does not compile; no worker was started. Fix it "
                f"and run again:\n{said}")
    return None
