"""Each run builds and reads its data under its own ``.cache``; nothing goes to the user-wide ``datasets`` cache.

Before: ``datasets`` built the tables (and their tokenised and shuffled copies) in
``~/.cache/huggingface/datasets``, in a directory keyed by the data files alone, so two runs over one
corpus at once shared it, and one read what the other was writing: a resumed checkpoint beside
another training process differed from the uninterrupted one in 113 of 215 blobs. Each run's data is
built in two live processes at once here, the user-wide caches pointed at a folder that must stay empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[2]

# What a run does with its data (neutrain.cli.train.build_trainer): a tokenizer trained on the texts, then the
# tokenised, shuffled and packed rows, all under <run>/.cache; the rows are written out to compare.
_BUILD = """
import json, sys
from neutrain.config import load_recipe
from neutrain.data import build_datasets, byte_tokenizer, iter_training_texts
corpus, cache, streaming, out = sys.argv[1:5]
recipe = load_recipe("default", [f"data.datasets=[{{path: {corpus}, type: text}}]", f"data.streaming={streaming}",
                                 "data.sequence_len=64", "data.val_set_size=0.1" if streaming == "false" else
                                 "data.val_set_size=0"])
texts = sum(len(t) for t in iter_training_texts(recipe.data, cache))
train, heldout = build_datasets(recipe.data, byte_tokenizer(), cache)
rows = [r["input_ids"] for r in train]
held = [r["input_ids"] for r in heldout] if heldout is not None else []
json.dump({"texts": texts, "train": rows, "heldout": held}, open(out, "w"))
"""


def _corpus(path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(400):
            fh.write(json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i % 17 + 1)}) + "\n")
    return path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("streaming", ["false", "true"])
def test_two_runs_building_data_at_once_get_the_same_rows_and_leave_the_user_wide_cache_empty(tmp_path, streaming):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    home = tmp_path / "home"
    home.mkdir()
    env = child_env(HOME=str(home), HF_HOME=str(home / "hf"), HF_DATASETS_CACHE=str(home / "datasets"),
                    XDG_CACHE_HOME=str(home / "xdg"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    runs = [tmp_path / f"run{i}" for i in (1, 2)]
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(corpus), str(run / ".cache"), streaming,
                               str(tmp_path / f"rows{i}.json")], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, run in enumerate(runs)]
    for proc in procs:
        _, err = proc.communicate(timeout=220)
        assert proc.returncode == 0, err[-2000:]
    first, second = (json.loads((tmp_path / f"rows{i}.json").read_text()) for i in range(2))
    assert first["train"] and first == second
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []  # nothing in the user-wide caches
    for run in runs:  # each run's tables lie in its own cache
        assert list((run / ".cache" / "datasets").iterdir())


def test_data_built_without_a_run_directory_goes_to_a_private_cache_removed_at_exit(tmp_path):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    home = tmp_path / "home"
    home.mkdir()
    env = child_env(HOME=str(home), HF_HOME=str(home / "hf"), HF_DATASETS_CACHE=str(home / "datasets"),
                    XDG_CACHE_HOME=str(home / "xdg"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code = ("import sys\nfrom neutrain.data import load_rows\nfrom neutrain.data.sources import private_cache\n"
            f"rows = load_rows({{'path': {str(corpus)!r}}})\nprint(len(rows), private_cache())")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    count, cache = done.stdout.split()
    assert int(count) == 400 and cache.startswith(str(tmp_path / "tmp"))
    assert not os.path.exists(cache)  # removed when the process ended
    assert list(home.rglob("*")) == [] and list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("damage", ["emptied", "cut short"])
def test_a_damaged_data_cache_is_built_again_from_the_files(tmp_path, damage):
    """``datasets`` writes its cache without fsync, inside the run's folder: a power cut can leave its files cut
    short. The next load builds it again from the corpus and reads the same rows, instead of failing on the cache."""
    from neutrain.data.sources import datasets_cache, load_rows

    corpus = _corpus(tmp_path / "corpus.jsonl")
    cache = tmp_path / "run" / ".cache"
    first = load_rows({"path": str(corpus)}, cache_dir=str(cache))["text"]
    # What an unsynced write leaves: the cache's JSON records emptied or cut (its arrow tables are memory-mapped
    # by pyarrow, which trusts their framing: a broken one is outside what a load can survive).
    damaged = [p for p in Path(datasets_cache(cache)).rglob("*.json") if p.is_file()]
    assert damaged
    for p in damaged:
        p.write_bytes(b"" if damage == "emptied" else p.read_bytes()[: len(p.read_bytes()) // 2])
    assert load_rows({"path": str(corpus)}, cache_dir=str(cache))["text"] == first
