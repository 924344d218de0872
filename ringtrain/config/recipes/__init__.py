"""Recipes: named sets of option values, one short file each, whose comments say why.

    ringtrain train --recipe shakespeare_char --data input.txt

A recipe is a Python file of assignments, as nanoGPT's config/*.py: each name is an option's
flag without the dashes (`--batch-size` is `batch_size`). Its values replace the defaults (the
task's included); the command line replaces the recipe's. `--recipe` takes a name here or the
path of such a file.
"""

from __future__ import annotations

import ast
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The recipes that ship with ringtrain."""
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("_"))


def load(recipe: str) -> dict[str, Any]:
    """{option: value} of a recipe named here or at a path. Raises ValueError naming the fix.

    Read as literals (`ast.literal_eval` of each assignment), not executed: a recipe is data.
    """
    path = recipe if recipe.endswith(".py") else os.path.join(HERE, f"{recipe}.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except OSError:
        raise ValueError(f"recipe={recipe!r}: no such recipe; choose one of {names()} or give the "
                         "path of a .py file of assignments") from None
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"recipe={recipe!r}: line {node.lineno} is not `name = value`")
        try:
            values[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            raise ValueError(f"recipe={recipe!r}: line {node.lineno}: the value must be a literal "
                             "(a number, a string, True/False)") from None
    return values
