"""Importing transformers never imports neutrain.kernels, and only neutrain* is installed."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
REPO = sys.argv[1]
import transformers
from transformers import Trainer, AutoModelForCausalLM
import neutrain
from neutrain.trainer import NeuTrainer
bad = [m for m in sys.modules if m.startswith('neutrain.kernels')]
k = sys.modules.get('kernels')
if k is not None and REPO in str(getattr(k, '__file__', '') or ''):
    bad.append('kernels from the repository')
print('BAD' if bad else 'OK', bad)
"""


def test_transformers_and_trainer_do_not_import_kernels_from_repo_root():
    # Run from the repository root, where a stray top-level kernels/ would shadow HF's package.
    res = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK"), res.stdout
    assert not (REPO / "kernels").exists(), "a top-level kernels/ package collides with Hugging Face's 'kernels'"


def test_distribution_contains_only_neutrain(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("neutrain-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    tops = {t for t in tops if not t.endswith((".dist-info", ".data"))}
    assert tops == {"neutrain"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "neutrain/kernels/__init__.py" in names
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "neutrain = neutrain.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()
