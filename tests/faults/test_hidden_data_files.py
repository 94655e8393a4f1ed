"""A data folder's hidden files are not data: a name, or a folder on its path inside the data folder, starting with
``.`` or ``__`` is left out with a warning naming it, as ``datasets`` leaves it out of a folder. Before, Jupyter's
``.ipynb_checkpoints/train-checkpoint.jsonl`` was trained on beside ``train.jsonl`` (every row twice, in silence), and
macOS's ``._train.jsonl`` or ``__MACOSX/`` (binary resource forks that Finder does not show) failed the run naming a
file the user never saw."""

from __future__ import annotations

import logging
from pathlib import PurePosixPath

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neutrain.data.sources import entry_files, load_rows
from neutrain.errors import DataError

# Hidden places a data folder holds in practice, each beside a visible train.<ext>.
HIDDEN = [".ipynb_checkpoints/train-checkpoint.{ext}", "._train.{ext}", "__MACOSX/._train.{ext}", ".train.{ext}",
          "sub/.cache/train.{ext}", "__pycache__/train.{ext}", ".git/objects/train.{ext}"]
EXTS = ["jsonl", "json", "csv", "txt", "md", "parquet", "text"]
RESOURCE_FORK = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \xff\xfe"


@pytest.mark.parametrize("ext", EXTS)
def test_every_hidden_place_of_every_data_type_is_left_out_with_a_warning(tmp_path, caplog, ext):
    (tmp_path / f"train.{ext}").write_text("x")
    for hidden in HIDDEN:
        path = tmp_path / hidden.format(ext=ext)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(RESOURCE_FORK)
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        assert entry_files({"path": str(tmp_path)}) == [str(tmp_path / f"train.{ext}")]
    warned = [r.getMessage() for r in caplog.records if "hidden" in r.getMessage()]
    assert len(warned) == 1 and f"{len(HIDDEN)} hidden file(s)" in warned[0] and str(tmp_path) in warned[0], warned


def test_a_folder_of_hidden_files_only_says_so(tmp_path):
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"holds no .* files other than hidden ones \(1, left out\)"):
        entry_files({"path": str(tmp_path)})


def test_a_jupyter_copy_beside_the_data_is_not_trained_on(tmp_path):
    rows = "".join(f'{{"text": "row {i}"}}\n' for i in range(3))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text(rows)
    (tmp_path / "._train.jsonl").write_bytes(RESOURCE_FORK)  # would fail the read as not UTF-8
    loaded = load_rows({"path": str(tmp_path), "type": "text", "ds_type": None}, cache_dir=str(tmp_path / "cache"))
    assert [row["text"] for row in loaded] == ["row 0", "row 1", "row 2"]


_PART = st.from_regex(r"(\.|__)?[a-z]{1,4}", fullmatch=True)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(paths=st.lists(st.tuples(st.lists(_PART, max_size=2), _PART, st.sampled_from(EXTS)), min_size=1, max_size=6,
                      unique_by=lambda p: (tuple(q.lstrip("._") for q in p[0]), p[1].lstrip("._"))))
def test_generated_trees_give_exactly_their_visible_files(tmp_path_factory, paths):
    root = tmp_path_factory.mktemp("data")
    made = set()
    for folders, name, ext in paths:
        relative = PurePosixPath(*folders, f"{name}.{ext}")
        if any(str(PurePosixPath(*relative.parts[:i])) in made for i in range(1, len(relative.parts))):
            continue  # a folder of this path is already a file
        target = root / relative
        if target.parent.exists() and not target.parent.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            continue
        target.write_text("x")
        made.add(str(relative))
    visible = sorted(str(root / p) for p in made if not any(part.startswith((".", "__")) for part in PurePosixPath(p).parts))
    if visible:
        assert sorted(entry_files({"path": str(root)})) == visible
    else:
        with pytest.raises(DataError, match="other than hidden ones"):
            entry_files({"path": str(root)})
