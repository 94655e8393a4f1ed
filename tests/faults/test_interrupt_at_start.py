"""Ctrl-C while a command is still starting is one line and exit 130, for every command and every import.

A SIGINT in the first half second of ``neutrain train R`` landed in an import (the package's own, pydantic's,
yaml's, the command module's, made while the arguments were parsed), before ``main`` could catch it: a
20-line ``KeyboardInterrupt`` traceback, exit 1 or -2. Here the child sends itself SIGINT at the moment a named
module starts to be imported (a finder that ``sitecustomize`` installs ahead of the others), so each point of
the start is hit exactly, not by a timer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from neutrain.cli.main import COMMANDS
from tests.helpers import REPO, child_env

SITECUSTOMIZE = '''
import os, signal, sys

class _InterruptAt:
    """Send this process SIGINT when {module!r} starts to be imported; then step aside."""
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _InterruptAt())
'''

# Points of the start every command passes: the package's imports, then the command line's module.
PACKAGE_IMPORTS = ["neutrain.export", "yaml", "pydantic", "neutrain.cli.main"]


def _interrupted_at(tmp_path, module: str, argv: list[str]) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE.format(module=module))
    return subprocess.run([sys.executable, "-m", "neutrain", *argv], cwd=tmp_path, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("point", [f"import {m}" for m in PACKAGE_IMPORTS] + [f"command {c}" for c in COMMANDS])
def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(tmp_path, point):
    kind, name = point.split()
    module, command = (name, "train") if kind == "import" else (COMMANDS[name].module, name)
    result = _interrupted_at(tmp_path, module, [command, str(tmp_path / "missing")])
    assert (result.returncode, result.stderr) == (130, "neutrain: interrupted\n"), result.stderr[-3000:]


def test_the_command_is_told_apart_from_a_program_that_imports_neutrain():
    from neutrain.starting import started_as_command

    assert started_as_command(["python", "-X", "dev", "-m", "neutrain", "eval"], ["-m"])
    assert started_as_command(["/env/bin/python", "/env/bin/neutrain"], ["/env/bin/neutrain"])
    assert not started_as_command(["python", "-m", "pytest", "-m", "neutrain"], ["-m"])  # pytest's lookup
    assert not started_as_command(["python", "-m", "pytest", "-m", "neutrain"], ["/env/bin/pytest"])
    assert not started_as_command(["python", "-c", "import neutrain"], ["-c"])
    assert not started_as_command(["python", "train.py", "-m", "neutrain"], ["train.py"])
