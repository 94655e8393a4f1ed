"""setuptools' PEP 517/660 backend, plus ``neutrain-recipe.pth`` at the root of every wheel it builds.

The .pth registers the ``neutrain-recipe`` source encoding (neutrain/config/recipe_codec.py) that
lets ``accelerate launch recipes/x.yaml`` run a recipe, and ends a launch its processes refused without
the launcher's traceback (neutrain/compat/elastic.py). setuptools has no way to place a file at
the root of site-packages for both kinds of install: ``data-files`` land in ``sys.prefix``, and its
editable wheels carry neither data files nor extra build outputs. So the finished wheel, regular
(``pip install .``) or editable (``pip install -e .``), gets the file added here, with its line
in RECORD, which is what makes ``pip uninstall`` remove it. Everything else is setuptools'.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other hook unchanged)

PTH = Path(__file__).resolve().parents[1] / "neutrain-recipe.pth"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(Path(wheel_directory) / name)
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(Path(wheel_directory) / name)
    return name


def add_pth(wheel: Path, pth: Path = PTH) -> None:
    """Rewrite ``wheel`` with ``pth`` at its root and a RECORD line for it (RECORD stays the last entry)."""
    data = pth.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        records = [info for info in src.infolist() if info.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(records)}")
        for info in src.infolist():
            if info is not records[0] and info.filename != pth.name:
                dst.writestr(info, src.read(info))
        dst.writestr(pth.name, data)
        lines = [line for line in src.read(records[0]).decode().splitlines() if not line.startswith(pth.name + ",")]
        lines.insert(len(lines) - 1, f"{pth.name},sha256={digest},{len(data)}")  # before RECORD's own line
        dst.writestr(records[0], "\n".join(lines) + "\n")
    tmp.replace(wheel)
