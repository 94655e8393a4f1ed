"""``neutrain.memory`` is used through its package's names only: no module outside it imports one of its modules.

Why: the planner, the fit, the phase model and the residency once lived in four packages, and ``cli/``
reached into planning through many file pairs; a split or rename inside the package then broke callers
all over. The public names are those of ``neutrain/memory/__init__.py``; every module of the package is
private to it. Tests of the package's own modules (here, ``tests/unit/memory/``) may import them.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import neutrain.memory as memory

REPO = pathlib.Path(__file__).resolve().parents[3]
PACKAGE = REPO / "neutrain" / "memory"
PRIVATE = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}


def private_imports(path: pathlib.Path) -> list[str]:
    """``line: neutrain.memory.<module>`` for each import of a module of the package in ``path``, lazy ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            # ``from neutrain.memory import fit`` imports the module ``fit``; ``import choose_fit`` does not
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "neutrain.memory"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["neutrain", "memory"] and len(parts) > 2 and parts[2] in PRIVATE:
                found.append(f"{node.lineno}: {name}")
    return found


def _outside() -> list[pathlib.Path]:
    files = [p for p in (REPO / "neutrain").rglob("*.py") if PACKAGE not in p.parents]
    return files + sorted((REPO / "benchmarks").rglob("*.py"))


def test_nothing_outside_the_package_imports_its_modules():
    found = [f"{path.relative_to(REPO)}:{hit}" for path in _outside() for hit in private_imports(path)]
    assert not found, ("import these from neutrain.memory itself (add the name to its PUBLIC if it is new):\n"
                       + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ("from neutrain.memory import choose_fit, Placement\n", []),
    ("from neutrain.memory.fit import choose_fit\n", ["1: neutrain.memory.fit"]),
    ("def f():\n    from neutrain.memory.planner import GIB  # lazy: torch\n", ["2: neutrain.memory.planner"]),
    ("import neutrain.memory.planner\n", ["1: neutrain.memory.planner"]),
    ("from neutrain.memory import phases\n", ["1: neutrain.memory.phases"]),
    ("import importlib\nimportlib.import_module('neutrain.memory.residency')\n", ["2: neutrain.memory.residency"]),
])
def test_the_scan_sees_every_kind_of_private_import(tmp_path, source, expected):
    (tmp_path / "probe.py").write_text(source)
    assert private_imports(tmp_path / "probe.py") == expected


def test_every_public_name_is_defined_where_the_package_says():
    for name, module in memory.PUBLIC.items():
        assert module in PRIVATE, f"{name}: no module neutrain/memory/{module}.py"
        assert getattr(memory, name) is not None


def test_the_package_and_the_planner_import_without_torch():
    # `neutrain estimate` plans from the recipe's own numbers: the package's names must not pull torch in.
    code = ("import sys, neutrain.memory as m; m.estimate_recipe, m.choose_fit, m.Placement, m.decide; "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
