"""Runs that were silently wrong, or failed with a misleading message, now say what is wrong.

Before: ``train.max_steps: 0`` trained one step logged "step 1/0"; model files were
written mode 0600 (safetensors 0.8) among 0644 files; ``"text": null`` was reported as a missing field
of a file that has it; a FIFO or ``/dev/zero`` named ``x.txt`` was blamed on its extension; a read-only
``HOME``/``HF_HOME`` was a data error (exit 2); a symlinked checkpoint met when saving failed with
"Cannot call rmtree on a symbolic link", no path named, temporaries left.
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from neutrain.cli import main as neutrain
from tests.faults.test_data_errors import _jsonl, _no_progress_bars, _one_line_error, _recipe  # noqa: F401 (fixture)
from tests.faults.test_run_lifecycle import QUIET
from tests.helpers import write_recipe


def test_max_steps_0_is_refused_in_one_line(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 0}, **QUIET)
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line == ("neutrain: error: train.max_steps: 0 trains nothing; give a number of steps > 0, or -1 to train "
                    "train.num_epochs epochs")
    assert not (tmp_path / "out").exists()


def test_every_file_of_a_checkpoint_and_an_export_has_the_umasks_mode(tmp_path):
    umask = 0o027  # neither 0600 (safetensors 0.8's) nor the usual 0644: the files follow the umask
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": False},
                          export={"format": "hf"})
    previous = os.umask(umask)
    try:
        assert neutrain(["train", str(recipe)]) == 0
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode)
             for d in (out / "checkpoint-2", out / "export") for p in d.iterdir() if p.is_file()}
    assert "checkpoint-2/model.safetensors" in modes and "export/model.safetensors" in modes
    assert {name: oct(m) for name, m in modes.items() if m != 0o666 & ~umask} == {}


def test_a_null_text_is_called_null_with_its_row(tmp_path, capsys):
    rows = _jsonl([{"text": "a first document"}, {"text": None}])
    recipe = _recipe(tmp_path, {"n.jsonl": rows}, [{"path": "n.jsonl", "type": "text"}])
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line == f"neutrain: error: {tmp_path / 'n.jsonl'}: row 1: field 'text' is null or missing in this row (other rows have it); expected str"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_device_named_txt_is_said_to_be_no_regular_file(tmp_path, capsys, kind):
    path = tmp_path / "x.txt"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    recipe = _recipe(tmp_path, {}, [{"path": "x.txt", "type": "text"}])
    line = _one_line_error(capsys, ["train", str(recipe)])
    what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
    assert line == (f"neutrain: error: data.datasets[0].path: data file '{path}' is {what}, not a regular file or a "
                    "directory")


def test_a_read_only_hf_home_is_an_environment_error_naming_the_variable(tmp_path, capsys, monkeypatch):
    """As root nothing is read-only here: ``datasets`` is made to fail the way it does on a read-only HF_HOME."""
    import datasets

    home = tmp_path / "ro-hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    cache = home / "datasets" / "json"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(cache))

    monkeypatch.setattr(datasets, "load_dataset", read_only)
    recipe = _recipe(tmp_path, {"d.jsonl": _jsonl([{"text": "hello"}])}, [{"path": "d.jsonl", "type": "text"}])
    assert neutrain(["train", str(recipe)]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"neutrain: error: HF_HOME={home} is not writable, and the datasets cache is written under it; "
                     f"point HF_HOME (or HF_DATASETS_CACHE) at a writable directory ({cache}): Read-only file system"]


def test_a_symlinked_checkpoint_is_named_not_followed_and_leaves_no_temporaries(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere" / "checkpoint-2"
    elsewhere.mkdir(parents=True)
    (elsewhere / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-2").symlink_to(elsewhere)
    recipe = write_recipe(tmp_path, train={"max_steps": 4, "save_steps": 2, "save_total_limit": 1}, **QUIET)
    line = _one_line_error(capsys, ["train", str(recipe)])
    assert line == (f"neutrain: error: {out / 'checkpoint-2'} is a symbolic link (to {elsewhere}); neutrain does not "
                    f"replace or delete checkpoints through links: move that checkpoint into {out}, or remove the link")
    assert not list(out.glob(".tmp-*"))
    assert (out / "checkpoint-2").is_symlink() and (elsewhere / "trainer_state.json").is_file()
