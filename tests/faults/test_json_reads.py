"""The JSON files inside a checkpoint, an export or a run directory are read through one guarded reader.

Each used to be read with ``json.loads(path.read_text())``: a FIFO in its place blocked the command forever,
a multi-GB file was read until memory ran out, a directory, bytes that are no UTF-8 or a truncated file ended in
a raw traceback, a JSON array where an object belongs failed later with an ``AttributeError``, and ``NaN`` was
taken though JSON has none. Each is now :func:`neutrain.files.read_json_object`: its kind and size are checked
before it is opened, and each fault is one line naming the file, raised as the project's error.

The table drives the functions the commands call (load a model, verify a checkpoint, plan its placement, plan a
resume) on a tiny model folder (a 2-layer Llama of 64 tokens, written once). A FIFO left waiting for a writer
is opened for writing after a few seconds, so a read that blocks fails the test instead of hanging it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from neutrain.errors import UserInputError
from neutrain.files import MAX_CONFIG_BYTES, MAX_FOLDER_TEXT_BYTES, MAX_RECORD_BYTES
from tests.helpers import TINY_LLAMA

PACKAGE = Path(__file__).resolve().parents[2] / "neutrain"
INDEX_BYTES = 64 << 20  # neutrain.storage.confine's bound on a safetensors index

# A file planted where a JSON file belongs: (how it is made, given the path and that file's size bound).
BAD = {
    "fifo": lambda path, limit: os.mkfifo(path),
    "directory": lambda path, limit: path.mkdir(),
    "too big": lambda path, limit: _sparse(path, limit + 1),
    "not UTF-8": lambda path, limit: path.write_bytes(b'{"a": "caf\xe9"}'),
    "invalid JSON": lambda path, limit: path.write_bytes(b'{"a": '),
    "JSON array": lambda path, limit: path.write_bytes(b"[1, 2]"),
    "NaN": lambda path, limit: path.write_bytes(b'{"a": NaN}'),
}


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as fh:  # no bytes written: the size is what the reader must refuse unread
        fh.truncate(size)


@contextmanager
def _no_hang(path: Path, seconds: float = 10.0):
    """Fail, rather than block, when the code under test opens the FIFO ``path`` for reading: after ``seconds``,
    and as often as a reader waits again, a writer opens it (a reader blocked in ``open``, even inside a library
    that retries on EINTR, then reads EOF)."""
    blocked, done = threading.Event(), threading.Event()

    def release():
        if done.wait(seconds):
            return
        while not done.wait(0.2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                blocked.set()
            except OSError:  # ENXIO: no reader waits on it now
                pass

    watchdog = threading.Thread(target=release, daemon=True) if stat.S_ISFIFO(os.lstat(path).st_mode) else None
    if watchdog is not None:
        watchdog.start()
    try:
        yield
    finally:
        done.set()
    assert not blocked.is_set(), f"a FIFO at {path} was opened for reading: the command blocked on it"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A Hugging Face folder of a tiny Llama (config.json, generation_config.json, model.safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=64)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _copy(tiny_model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(tiny_model, folder)
    return folder


# ---- the drivers: what a command calls on the folder, once the named file is planted ----

def _load(folder: Path):
    from neutrain.export import load_checkpoint_model

    load_checkpoint_model(folder, verified=True)  # as neutrain generate calls it, after its own verify


def _placement(folder: Path):
    from neutrain.cli.placement import resolve

    resolve(folder, 1 << 30, prompt_tokens=4, new_tokens=4)


def _verify(folder: Path):
    from neutrain.storage.manifest import verify_checkpoint

    verify_checkpoint(folder)


def _resume(folder: Path):
    from neutrain.config.sections import TrainSection
    from neutrain.trainer.run_state import plan_resume

    plan_resume(TrainSection(output_dir=str(folder.parent), resume_from_checkpoint=True, max_steps=4, num_epochs=1.0,
                             lr_scheduler="linear", warmup_steps=0, learning_rate=1e-3))


def _adapter(folder: Path):
    from neutrain.export.lora import load_adapter_checkpoint

    load_adapter_checkpoint(folder)


def _plant_marker(folder: Path) -> None:
    (folder / "neutrain_weights.json").write_text(json.dumps({"weights": "neuzip-lossless", "format": "neuzip-blobs"}))


def _plant_manifest(folder: Path) -> None:
    from neutrain.storage.manifest import write_manifest

    write_manifest(folder)


# (file, its size bound, driver, what is written first so the driver reaches the file)
FILES = {
    "config.json/load": ("config.json", MAX_CONFIG_BYTES, _load, None),
    "config.json/placement": ("config.json", MAX_CONFIG_BYTES, _placement, None),
    "neutrain_weights.json/load": ("neutrain_weights.json", MAX_CONFIG_BYTES, _load, _plant_marker),
    "trainer_state.json/resume": ("trainer_state.json", MAX_RECORD_BYTES, _resume, None),
    "neutrain_manifest.json/verify": ("neutrain_manifest.json", MAX_RECORD_BYTES, _verify, _plant_manifest),
    "model.safetensors.index.json/verify": ("model.safetensors.index.json", INDEX_BYTES, _verify, None),
    "adapter_config.json/load": ("adapter_config.json", MAX_CONFIG_BYTES, _adapter, None),
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("case", list(FILES))
def test_a_bad_json_file_is_one_line_naming_it(tiny_model, tmp_path, case, bad):
    name, limit, driver, prepare = FILES[case]
    folder = _copy(tiny_model, tmp_path)
    if prepare is not None:
        prepare(folder)
    path = folder / name
    if path.exists():
        path.unlink()
    BAD[bad](path, limit)
    with _no_hang(path), pytest.raises(UserInputError) as caught:  # any other exception fails the test as it is
        driver(folder)
    message = str(caught.value)
    assert "\n" not in message, message
    assert name in message, message


def test_the_well_formed_folder_passes_every_driver(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 4,
                                                           "log_history": [{"loss": float("nan"), "step": 1}]}))
    for driver in (_load, _placement, _resume):
        driver(folder)
    _plant_manifest(folder)
    _verify(folder)
    marked = _copy(tiny_model, tmp_path / "compressed")
    _plant_marker(marked)
    from neutrain.nn.formats import folder_format

    assert folder_format(marked).source().weights == "neuzip-lossless"


def _best_effort_reads(folder: Path) -> dict:
    """The reads that tolerate a missing or broken file on purpose, each with its fallback value."""
    from neutrain.cli.checkpoints import run_facts, trained_with_chat_template
    from neutrain.export.target import is_export, source_changed
    from neutrain.trainer.resume_check import saved_record
    from neutrain.trainer.run_state import summarised

    return {"is_export": is_export(folder), "source_changed": source_changed(folder),
            "chat_template": trained_with_chat_template(folder), "facts": run_facts(folder),
            "summarised": summarised(folder, 2), "record": saved_record(folder)}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", ["neutrain_export.json", "summary.json", "trainer_state.json", "config.json"])
def test_a_best_effort_read_falls_back_without_blocking(tiny_model, tmp_path, name, bad):
    folder = _copy(tiny_model, tmp_path)
    path = folder / name
    if path.exists():
        path.unlink()
    BAD[bad](path, MAX_RECORD_BYTES if name == "trainer_state.json" else MAX_CONFIG_BYTES)
    with _no_hang(path):
        seen = _best_effort_reads(folder)
    assert seen["is_export"] is False and seen["source_changed"] is None and seen["summarised"] is False
    assert seen["chat_template"] is None and "steps" not in seen["facts"]
    assert "model.config.hidden_size" not in seen["record"] or name != "config.json"


# A base model's files that its fingerprint hashes whole, raw bytes rather than JSON: only the faults of the kind.
RAW_BAD = {"fifo": BAD["fifo"], "directory": BAD["directory"], "too big": BAD["too big"],
           "device": lambda path, limit: path.symlink_to("/dev/zero")}


@pytest.mark.parametrize("bad", list(RAW_BAD))
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_bad_file_of_a_base_model_stops_its_fingerprint_in_one_line(tiny_model, tmp_path, name, bad):
    from neutrain.storage.fingerprint import model_fingerprint  # what a LoRA run and a merge onto --base call

    folder = _copy(tiny_model, tmp_path)
    path = folder / name
    if path.exists():
        path.unlink()
    RAW_BAD[bad](path, MAX_FOLDER_TEXT_BYTES)
    with _no_hang(path), pytest.raises(UserInputError) as caught:
        model_fingerprint(folder)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message


# ---- the scan: no module reads a JSON file around the reader ----

# (module, the read's own text): why it may read its own way.
ALLOWED = {
    ("export/neuzip.py", 'json.loads((tmp / "config.json").read_text())'):
        "reads back the config.json it has just written itself, in its own temporary directory",
    ("data/sources.py", "json.load(fh)"):
        "names the bad row of a data file that neutrain.data.bounds has already checked and bounded",
}


def _raw_json_reads(tree: ast.AST) -> list[int]:
    """Lines calling ``json.load(...)``, or ``json.loads`` on a ``.read_text()`` / ``.read_bytes()`` result."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"):
            continue
        if node.func.attr == "load":
            lines.append(node.lineno)
        elif node.func.attr == "loads" and any(
                isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                and inner.func.attr in ("read_text", "read_bytes", "read") for arg in node.args for inner in ast.walk(arg)):
            lines.append(node.lineno)
    return lines


def _scan(find, allowances: dict) -> tuple[list[str], set]:
    """``module:line: text`` of each read ``find`` finds in the package and ``allowances`` does not name, and the
    allowances that named one."""
    stray, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for line in find(ast.parse(source)):
            allowed = [key for key in allowances if key[0] == rel and key[1] in lines[line - 1]]
            used.update(allowed)
            if not allowed:
                stray.append(f"{rel}:{line}: {lines[line - 1].strip()}")
    return stray, used


def test_the_scan_sees_every_way_of_reading_a_json_file():
    source = ("import json\njson.loads(p.read_text())\njson.loads(p.read_bytes().decode())\njson.load(fh)\n"
              "json.loads(fh.read())\njson.loads(text)\n")
    assert _raw_json_reads(ast.parse(source)) == [2, 3, 4, 5]


# ---- the scan: no module reads a file whole around the bounded reader ----

# (module, the read's own text): why it may read its own way.
RAW_ALLOWED = {
    ("export/neuzip.py", 'json.loads((tmp / "config.json").read_text())'):
        "reads back the config.json it has just written itself, in its own temporary directory",
    ("data/sources.py", 'f.read_text(encoding="utf-8", errors="replace")'):
        "a data folder's text file, which neutrain.data.bounds has already checked for its kind and bounded",
}


def _raw_file_reads(tree: ast.AST) -> list[int]:
    """Lines calling a path's ``.read_text()`` / ``.read_bytes()`` (pathlib's: no bound, no kind check), not the
    functions of ``neutrain.files`` of those names."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("read_text", "read_bytes")
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "files")]


@pytest.mark.parametrize("find, allowances, around", [
    (_raw_json_reads, ALLOWED, "neutrain.files.read_json_object"),
    (_raw_file_reads, RAW_ALLOWED, "neutrain.files.read_bytes / read_text")], ids=["json", "whole file"])
def test_the_package_reads_no_file_but_through_the_reader(find, allowances, around):
    stray, used = _scan(find, allowances)
    assert not stray, f"files read around {around}:\n" + "\n".join(stray)
    assert used == set(allowances), f"allowances whose read is gone: {sorted(set(allowances) - used)}"


def test_the_raw_read_scan_sees_a_path_read_and_not_the_reader():
    source = ("from neutrain import files\nfrom neutrain.files import read_text\n(p / 'config.json').read_bytes()\n"
              "p.read_text(encoding='utf-8')\nread_text(p, 'l', 1, ValueError)\nfiles.read_bytes(p, 'l', 1, ValueError)\n")
    assert _raw_file_reads(ast.parse(source)) == [3, 4]
