"""The neutrain-recipe source encoding: recipes stay plain YAML and python runs them as neutrain's CLI."""

from __future__ import annotations

import codecs
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neutrain.config import load_recipe
from neutrain.config import recipe_codec
from neutrain.config.recipe_yaml import parse_recipe_text
from tests.helpers import load_shipped_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# PEP 263: the declaration python honours on line 1 or 2.
CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


@pytest.fixture
def registered():
    """The codec registered in this process, as the installed .pth does at start-up."""
    codecs.register(recipe_codec.search)
    yield
    codecs.unregister(recipe_codec.search)


def test_every_shipped_recipe_is_executable_declares_the_codec_and_is_plain_yaml():
    assert RECIPES, "no shipped recipes"
    git = shutil.which("git")
    modes = {}
    if git and (REPO / ".git").exists():
        out = subprocess.run([git, "ls-files", "-s", "recipes"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        modes = {Path(line.split("\t")[1]).name: line.split()[0] for line in out.splitlines()}
    for path in RECIPES:
        assert os.access(path, os.X_OK), f"{path.name}: not executable (chmod +x; git update-index --chmod=+x)"
        if modes:
            assert modes.get(path.name) == "100755", f"{path.name}: git mode {modes.get(path.name)}, expected 100755"
        first, second = path.read_text().splitlines()[:2]
        assert first.startswith("#!"), f"{path.name}: line 1 must be the shebang"
        match = CODING.match(second)
        assert match and match.group(1) == recipe_codec.NAME, f"{path.name}: line 2 must be '# coding: {recipe_codec.NAME} ...'"
        # The declaration is a YAML comment: plain PyYAML and neutrain's loader read the same mapping.
        plain = yaml.safe_load(path.read_text())
        assert plain == parse_recipe_text(path.read_bytes(), path.name)
        assert set(plain) <= {"model", "data", "train", "memory", "eval", "export", "distill", "lora"}
        load_shipped_recipe(path)


def test_python_runs_a_recipe_as_neutrain_train_with_its_arguments(tmp_path, registered, monkeypatch):
    recipe = tmp_path / "r.yaml"
    shutil.copy2(REPO / "recipes" / "default.yaml", recipe)
    calls = []
    import neutrain.cli

    monkeypatch.setattr(neutrain.cli, "main", lambda argv: calls.append(argv) or 7)
    monkeypatch.setattr(sys, "argv", [str(recipe), "train.max_steps=2", "eval.perplexity=false"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(recipe), run_name="__main__")
    assert exit_info.value.code == 7
    assert calls == [["train", str(recipe), "train.max_steps=2", "eval.perplexity=false"]]


def test_python_interpreter_runs_the_recipe_through_the_codec(tmp_path):
    """CPython's own file tokenizer (not runpy) reading a recipe: the decoded script is what runs."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import codecs, runpy, sys\n"
        "from neutrain.config import recipe_codec\n"
        "codecs.register(recipe_codec.search)\n"
        "import neutrain.cli\n"
        "neutrain.cli.main = lambda argv: print('ARGV', argv) or 0\n"
        "sys.argv = sys.argv[1:]\n"
        "exec(compile(open(sys.argv[0], 'rb').read(), sys.argv[0], 'exec'), {'__file__': sys.argv[0], '__name__': '__main__'})\n"
    )
    recipe = tmp_path / "r.yaml"
    shutil.copy2(REPO / "recipes" / "neuzip_cpu.yaml", recipe)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, str(probe), str(recipe), "a=1"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"ARGV ['train', '{recipe}', 'a=1']" in res.stdout


def test_decoders_yield_the_script_once_whatever_the_chunking(registered):
    data = (REPO / "recipes" / "default.yaml").read_bytes()
    assert data.decode(recipe_codec.NAME) == recipe_codec.SCRIPT
    dec = codecs.getincrementaldecoder(recipe_codec.NAME)()
    text = "".join(dec.decode(data[i:i + 7]) for i in range(0, len(data), 7)) + dec.decode(b"", final=True)
    assert text == recipe_codec.SCRIPT
    # CPython's tokenizer discards the first line it reads through the codec: the script must survive that.
    assert text.startswith("\n") and "neutrain.cli" in text.splitlines()[1]
    assert "x".encode(recipe_codec.NAME) == b"x"
    assert codecs.lookup(recipe_codec.NAME.upper()).name == recipe_codec.NAME


def test_pth_file_is_the_module_line_and_installs_into_site_packages():
    pth = REPO / "neutrain-recipe.pth"
    assert pth.read_text() == recipe_codec.PTH_LINE
    assert recipe_codec.PTH_LINE.startswith("import ") and recipe_codec.PTH_LINE.count("\n") == 1  # site.py execs one line
    pyproject = (REPO / "pyproject.toml").read_text()  # (no tomllib: Python 3.10 is supported)
    # The in-tree backend adds the file to every wheel, regular and editable (tests/unit/test_packaging.py builds both).
    assert 'build-backend = "neutrain_backend"' in pyproject and 'backend-path = ["build_backend"]' in pyproject


def test_pth_line_imports_nothing_until_a_recipe_is_opened():
    """Start-up cost: the .pth only registers a lambda; neutrain is imported on the first lookup of its codec."""
    probe = (
        "import sys; before = set(sys.modules)\n"
        f"exec({recipe_codec.PTH_LINE!r})\n"
        "assert set(sys.modules) == before, sorted(set(sys.modules) - before)\n"
        "import codecs\n"
        "try:\n    codecs.lookup('no-such-codec')\nexcept LookupError:\n    pass\n"
        "assert 'neutrain' not in sys.modules\n"
        "assert codecs.lookup('neutrain-recipe').name == 'neutrain-recipe'\n"
        "assert 'neutrain.config.recipe_codec' in sys.modules\n"
        "print('OK')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr
