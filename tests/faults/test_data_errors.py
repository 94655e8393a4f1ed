"""Data faults: data that trains nothing, unreadable or empty data, and misleading messages.

Each case goes through ``neutrain.cli.main`` on a tiny recipe and must end with exit code 2 and one line
on stderr naming the file (and the row, the roles or the lengths), never a traceback. The checks run
while the data is tokenised, so every case stops before a model is built.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from neutrain.cli import main
from tests.helpers import write_recipe

CONVERSATION = [{"role": "human", "content": "hi there"}, {"role": "gpt", "content": "hello!"}]


@pytest.fixture(autouse=True)
def _no_progress_bars():
    """datasets draws progress bars on stderr; off here so stderr holds only what neutrain prints."""
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar

    disable_progress_bar()
    yield
    enable_progress_bar()


def _jsonl(rows: list) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _recipe(tmp_path: Path, files: dict[str, str], entries: list[dict], data: dict | None = None, model: dict | None = None) -> Path:
    """A tiny recipe over ``files`` (written into tmp_path); entry paths are file names in tmp_path."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    datasets = [{**e, "path": str(tmp_path / e["path"])} for e in entries]
    return write_recipe(
        tmp_path, data={"datasets": datasets, "sequence_len": 64, **(data or {})}, model=model or {},
        train={"max_steps": 1, "save_steps": 1, "micro_batch_size": 2}, eval={"perplexity": False}, export={"format": "none"},
    )


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, check exit 2 and a single stderr line without a traceback; return that line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("neutrain: error: ")
    return lines[0]


TRAIN_BPE = {"tokenizer": "train-bpe", "tokenizer_vocab_size": 300}
GOOD_TEXT = _jsonl([{"text": "hello world, this is text"}] * 3)

# (id, files, dataset entries, data overrides, model overrides, patterns the one line must match)
CASES = [
    # Class 8: data with no trainable token trained nothing and exited 0.
    ("chat-roles-not-trained", {"d.jsonl": _jsonl([{"messages": CONVERSATION}] * 6)}, [{"path": "d.jsonl", "type": "messages"}], {}, {},
     [r"d\.jsonl: no token to train on in its 6 rows", r"roles seen: gpt, human", r"data\.roles_to_train is \[assistant\]",
      r"set data\.roles_to_train: \[gpt\]"]),
    ("chat-roles-not-trained-streaming", {"d.jsonl": _jsonl([{"messages": CONVERSATION}] * 6)}, [{"path": "d.jsonl", "type": "messages"}],
     {"streaming": True}, {}, [r"d\.jsonl: no token to train on in the first 6 rows", r"roles seen: gpt, human", r"roles_to_train"]),
    ("assistant-turns-past-sequence-len", {"d.jsonl": _jsonl([{"messages": [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "ok"}]}] * 3)},
     [{"path": "d.jsonl", "type": "messages"}], {}, {},
     [r"d\.jsonl: no token to train on in its 3 rows", r"roles seen: assistant, user", r"starts at or after data\.sequence_len=64 tokens"]),
    ("prompts-longer-than-sequence-len", {"d.jsonl": _jsonl([{"prompt": "x" * 100, "completion": "y"}] * 5)},
     [{"path": "d.jsonl", "type": "completion"}], {}, {},
     [r"d\.jsonl: no token to train on", r"every prompt is at least data\.sequence_len=64 tokens long \(prompts of 100 to 100 tokens\)"]),
    ("heldout-split-trains-nothing", {"t.jsonl": GOOD_TEXT, "v.jsonl": _jsonl([{"messages": CONVERSATION}] * 4)},
     [{"path": "t.jsonl"}, {"path": "v.jsonl", "type": "messages", "split": "validation"}], {}, {},
     [r"v\.jsonl: no token to train on in its 4 rows", r"roles seen: gpt, human"]),
    # ShareGPT-style data: neutrain reads {role, content} under messages_field; the error says which key or rename.
    ("sharegpt-from-value", {"d.jsonl": _jsonl([{"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}])},
     [{"path": "d.jsonl", "type": "messages"}], {}, {}, [r"d\.jsonl: row 0: message 0 has ShareGPT keys", r"from -> role", r"roles_to_train"]),
    ("sharegpt-conversations-column", {"d.jsonl": _jsonl([{"conversations": CONVERSATION}])}, [{"path": "d.jsonl", "type": "messages"}], {}, {},
     [r"d\.jsonl: row 0: no field 'messages'", r"set messages_field: conversations"]),
    # Class 11 (data): tracebacks.
    ("empty-txt", {"d.txt": ""}, [{"path": "d.txt"}], {}, {}, [r"d\.txt: no token to train on in its 1 row: every document is empty or a single token"]),
    ("empty-txt-train-bpe", {"d.txt": ""}, [{"path": "d.txt"}], {}, TRAIN_BPE, [r"d\.txt: no token to train on"]),
    ("one-token-documents", {"d.jsonl": _jsonl([{"text": ""}] * 3)}, [{"path": "d.jsonl"}], {}, {},
     [r"d\.jsonl: no token to train on in its 3 rows: every document is empty or a single token"]),
    ("one-row-split-for-heldout", {"d.txt": "a"}, [{"path": "d.txt"}], {"val_set_size": 0.2}, {},
     [r"data\.val_set_size: 0\.2 of 1 training row\(s\) leaves 0 to train on"]),
    ("train-bpe-invalid-json", {"d.jsonl": GOOD_TEXT + "{not json\n"}, [{"path": "d.jsonl"}], {}, TRAIN_BPE,
     [r"d\.jsonl: row 3 \(line 4\) is not valid JSON"]),
    ("train-bpe-row-not-an-object", {"d.jsonl": GOOD_TEXT + "[1, 2]\n"}, [{"path": "d.jsonl"}], {}, TRAIN_BPE,
     [r"d\.jsonl: row 3 \(line 4\) is a list, expected a JSON object"]),
    ("streaming-invalid-json", {"d.jsonl": GOOD_TEXT + "{not json\n"}, [{"path": "d.jsonl"}], {"streaming": True}, {},
     [r"d\.jsonl: row 3 \(line 4\) is not valid JSON"]),
    # Class 14 (part): an empty jsonl said "StopIteration".
    ("empty-jsonl", {"d.jsonl": ""}, [{"path": "d.jsonl", "type": "completion"}], {}, {}, [r"d\.jsonl: no rows \(it is empty\)"]),
    ("empty-jsonl-streaming", {"d.jsonl": "\n"}, [{"path": "d.jsonl", "type": "completion"}], {"streaming": True}, {},
     [r"d\.jsonl: no rows \(it is empty\)"]),
]


@pytest.mark.parametrize("files,entries,data,model,patterns", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_data_is_one_line_and_exit_2(tmp_path, capsys, files, entries, data, model, patterns):
    line = _one_line_error(capsys, [str(_recipe(tmp_path, files, entries, data, model))])
    assert "StopIteration" not in line
    for pattern in patterns:
        assert re.search(pattern, line), f"{pattern!r} not in: {line}"


def test_max_samples_that_pick_only_untrained_rows_are_refused(tmp_path, capsys):
    """One trained row among 20: the entry passes (with a warning), but max_samples: 1 picks an untrained one."""
    rows = [{"prompt": "x" * 100, "completion": "y"}] * 19 + [{"prompt": "q", "completion": "a"}]
    recipe = _recipe(tmp_path, {"d.jsonl": _jsonl(rows)}, [{"path": "d.jsonl", "type": "completion"}], {"max_samples": 1})
    line = _one_line_error(capsys, [str(recipe)])
    assert "the training data has no token to train on after data.max_samples" in line


def test_many_truncated_rows_warn_with_counts(tmp_path, capsys, caplog):
    """4 of 10 completions are cut at sequence_len: the run trains, and a warning gives the counts."""
    rows = [{"prompt": "q", "completion": "a" * 100}] * 4 + [{"prompt": "q", "completion": "a"}] * 6
    recipe = _recipe(tmp_path, {"d.jsonl": _jsonl(rows)}, [{"path": "d.jsonl", "type": "completion"}])
    with caplog.at_level(logging.WARNING, logger="neutrain.data"):
        assert main([str(recipe)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "neutrain.data"]
    assert len(warnings) == 1, warnings
    assert re.search(r"d\.jsonl: of its 10 rows, 0 train no token and 4 were truncated at data\.sequence_len=64 \(40%, more than 10%\)",
                     warnings[0]), warnings[0]


def test_few_truncated_rows_do_not_warn(tmp_path, caplog):
    """1 of 20 rows cut (5%) is under the 10% threshold: no warning."""
    from neutrain.config import load_recipe
    from neutrain.data import build_datasets, byte_tokenizer

    rows = [{"prompt": "q", "completion": "a" * 100}] + [{"prompt": "q", "completion": "a"}] * 19
    recipe = load_recipe(_recipe(tmp_path, {"d.jsonl": _jsonl(rows)}, [{"path": "d.jsonl", "type": "completion"}], {"sample_packing": False}))
    with caplog.at_level(logging.WARNING, logger="neutrain.data"):
        train, _ = build_datasets(recipe.data, byte_tokenizer(), str(tmp_path / "cache"))
    assert len(train) == 20
    assert not [r for r in caplog.records if r.name == "neutrain.data"]


@pytest.mark.parametrize("with_recipe", [False, True], ids=["alone", "with-recipe"])
def test_eval_on_a_data_folder_says_what_it_found(tmp_path, capsys, with_recipe):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(GOOD_TEXT)
    argv = ["eval", str(tmp_path / "data")]
    if with_recipe:
        argv += ["--recipe", str(_recipe(tmp_path, {"d.jsonl": GOOD_TEXT}, [{"path": "d.jsonl"}]))]
    line = _one_line_error(capsys, argv)
    assert "is a checkpoint" not in line
    assert re.search(r"data' is not a checkpoint: it holds 1 data file\(s\) \(train\.jsonl\) and no config\.json", line), line
    assert "expected a checkpoint, an export or a run's output_dir" in line


def test_eval_on_a_data_file_says_it_is_data(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(GOOD_TEXT)
    line = _one_line_error(capsys, ["eval", str(tmp_path / "train.jsonl")])
    assert re.search(r"train\.jsonl' is a data file; expected a recipe YAML or a checkpoint directory", line), line


def test_streaming_bad_row_met_during_training_is_one_line(tmp_path, capsys):
    """A bad row past the 256 rows checked up front surfaces while training: still one line naming file and row."""
    good = _jsonl([{"text": f"document {i}"} for i in range(300)])
    recipe = _recipe(tmp_path, {"d.jsonl": good + "{not json\n"}, [{"path": "d.jsonl"}], {"streaming": True})
    line = _one_line_error(capsys, [str(recipe)])
    assert re.search(r"d\.jsonl: row 300 \(line 301\) is not valid JSON", line), line
