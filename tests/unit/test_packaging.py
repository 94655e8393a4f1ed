"""Importing transformers never imports neutrain.kernels; only neutrain* (and the launch codec's .pth) is installed."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
REPO = sys.argv[1]
import transformers
from transformers import Trainer, AutoModelForCausalLM
import neutrain
from neutrain.trainer import NeuTrainer
# The package's __init__ is standard library only (interpreting(), triton_available()); a kernel module is not.
bad = [m for m in sys.modules if m.startswith('neutrain.kernels.')]
k = sys.modules.get('kernels')
if k is not None and REPO in str(getattr(k, '__file__', '') or ''):
    bad.append('kernels from the repository')
print('BAD' if bad else 'OK', bad)
"""


@pytest.mark.slow
def test_transformers_and_trainer_do_not_import_kernels_from_repo_root():
    # Run from the repository root, where a stray top-level kernels/ would shadow HF's package.
    res = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK"), res.stdout
    assert not (REPO / "kernels").exists(), "a top-level kernels/ package collides with Hugging Face's 'kernels'"


@pytest.mark.slow
def test_distribution_contains_only_neutrain(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("neutrain-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    tops = {t for t in tops if not t.endswith((".dist-info", ".data"))}
    assert tops == {"neutrain", "neutrain-recipe.pth"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "neutrain/kernels/__init__.py" in names
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "neutrain = neutrain.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()
    _assert_ships_recipe_pth(wheel)


def _assert_ships_recipe_pth(wheel):
    """The wheel installs neutrain-recipe.pth into site-packages (its purelib), listed in RECORD so uninstall removes it."""
    import zipfile

    from neutrain.config.recipe_codec import PTH_LINE

    names = zipfile.ZipFile(wheel).namelist()
    pth = "neutrain-recipe.pth"
    assert [n for n in names if n.endswith(".pth") and not n.startswith("__editable__")] == [pth]
    assert zipfile.ZipFile(wheel).read(pth).decode() == PTH_LINE
    (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
    lines = zipfile.ZipFile(wheel).read(record).decode().splitlines()
    digest = base64.urlsafe_b64encode(hashlib.sha256(PTH_LINE.encode()).digest()).rstrip(b"=").decode()
    assert f"{pth},sha256={digest},{len(PTH_LINE.encode())}" in lines and lines[-1].startswith(record + ",")


def test_editable_wheel_ships_the_recipe_pth_too(tmp_path):
    """`pip install -e .` (PEP 660) builds through build_editable: the launch codec must come with it."""
    build = tmp_path / "build"
    # Without the environment the README's commands create in the checkout (.venv, .triton36: gigabytes, which
    # the build never reads; copying them was most of this test's time in CI).
    shutil.copytree(REPO, build, ignore=shutil.ignore_patterns(".git", ".venv", ".triton36", ".hypothesis", ".whl",
                                                                 ".carry", "__pycache__", "build", "dist", "*.egg-info",
                                                                 "outputs", "runs"))
    code = "import sys; sys.path.insert(0, 'build_backend'); import neutrain_backend as b; print(b.build_editable(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=build, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    _assert_ships_recipe_pth(tmp_path / res.stdout.strip().splitlines()[-1])


def test_the_cpu_install_brings_no_triton():
    """Triton (about 1 GB) runs nothing on a CPU: neither the dependencies nor the ``cpu`` extra name it; the
    test extra does, for the kernel tests on its CPU interpreter. torch's CUDA wheels bring it on a GPU."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}  # noqa: E731
    assert "triton" not in names(project["dependencies"])
    assert "triton" not in names(project["optional-dependencies"]["cpu"])
    assert "triton" in names(project["optional-dependencies"]["test"])
