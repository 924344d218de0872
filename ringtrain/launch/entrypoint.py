"""Is the thing `ringtrain run` was asked to start there? Checked before any worker starts.

    ringtrain run --nproc-per-node 2 no_such.py     # error: training script 'no_such.py' not found
    ringtrain run --nproc-per-node 2 -m no_such     # error: module 'no_such' not found

Without the check, N workers start, each dies of the same ImportError, and the user reads a
failure report for what was a typing mistake.

A module is looked up the way the workers' `python -u -m NAME` will: on the current directory
(which `-m` puts first on sys.path) and this interpreter's sys.path (PYTHONPATH included; the
workers run the same interpreter). Only finders are asked, so no package's `__init__` runs in the
launcher: a package whose import has side effects (CUDA, a process group) stays untouched.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder


def module_found(name: str, cwd: str | None = None) -> bool:
    """Whether `python -m name`, started in `cwd`, would find `name` (without importing it)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return False
    if parts[0] in sys.builtin_module_names:
        return len(parts) == 1
    path: list[str] | None = [cwd or os.getcwd(), *sys.path]
    for depth, part in enumerate(parts):
        spec = PathFinder.find_spec(part, path)
        if spec is None:
            return False
        if depth < len(parts) - 1:
            path = list(spec.submodule_search_locations or [])
            if not path:  # a plain module has no submodules
                return False
    return True


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
    if os.path.isfile(script):
        return None
    return (f"training script {script!r} not found (in {os.getcwd()}); pass a path to a .py "
            "file, or -m for a module")
