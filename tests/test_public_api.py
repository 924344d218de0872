"""ringtrain's top level: every public name resolves, in the module that defines it, and
`import ringtrain` stays cheap (a worker that never trains does not import the trainer).

    .venv/bin/pytest -q tests/test_public_api.py
"""

from __future__ import annotations

import ast
import subprocess
import sys

from architecture import PACKAGE, area

import ringtrain

# What `import ringtrain` may load eagerly: the process-group calls and what they stand on.
EAGER_AREAS = {"ringtrain", "runtime", "launch", "torch_internals", "errors", "store_keys"}


def test_every_public_name_resolves():
    for name in ringtrain.__all__:
        assert getattr(ringtrain, name) is not None, name
    assert set(ringtrain._LAZY) <= set(ringtrain.__all__)
    assert set(ringtrain._LAZY) <= set(dir(ringtrain))


def test_each_lazy_name_comes_from_the_module_the_table_names():
    for name, module in ringtrain._LAZY.items():
        value = getattr(ringtrain, name)
        assert value is getattr(sys.modules[module], name), name
        assert value.__module__ == module, f"{name} is defined in {value.__module__}, not {module}"


def test_the_type_checking_imports_match_the_lazy_table():
    # Type checkers read the imports under TYPE_CHECKING; the interpreter reads _LAZY.
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(n for n in tree.body
                 if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {a.name: n.module
                for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert imported == ringtrain._LAZY


def test_import_ringtrain_loads_no_trainer_strategy_or_engine():
    code = ("import sys, ringtrain; "
            "print(' '.join(m for m in sys.modules if m.startswith('ringtrain')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True).stdout.split()
    assert "ringtrain" in loaded
    heavy = sorted(m for m in loaded if area(m) not in EAGER_AREAS)
    assert heavy == [], "import ringtrain loads these; put them in _LAZY"


def test_the_python_api_of_docs_train_md_runs_as_written(tmp_path, monkeypatch, clean_env):
    # docs/train.md's "In Python" block with the short imports, 2 steps instead of 1000, in this
    # process (a world of one on the CPU, gloo), in a scratch directory.
    text = (PACKAGE.parent / "docs" / "train.md").read_text()
    block = text.split("### In Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "from ringtrain import Trainer, TrainerConfig, init_distributed, make_strategy" in block
    assert "steps=1000" in block
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ringtrain.training.report.write_report", lambda *args, **kwargs: None)
    scope: dict = {}
    exec(compile(block.replace("steps=1000", "steps=2"), "docs/train.md", "exec"), scope)
    assert scope["summary"]["steps"] == 2
    assert (tmp_path / "runs" / "mine" / "summary.json").exists()
