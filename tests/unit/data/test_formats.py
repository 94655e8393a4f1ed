import json

import pytest

from neutrain.config.sections import DataSection
from neutrain.config import DataError, validate_recipe
from neutrain.data import IGNORE_INDEX, build_datasets, byte_tokenizer, pack_rows
from neutrain.data.formats import tokenize_row
from tests.helpers import TINY_RECIPE


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _entry(**kw):
    base = {"path": "x", "type": "text", "ds_type": None, "split": "train", "text_field": "text", "prompt_field": "prompt",
            "completion_field": "completion", "messages_field": "messages", "max_files": None}
    base.update(kw)
    return base


CFG = DataSection.model_construct(sequence_len=64, train_on_inputs=False, roles_to_train=["assistant"])


def test_byte_tokenizer_round_trips_unicode(tok):
    text = "def f(x):\n    return 'héllo ✓'\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_text_rows_are_chunked_not_truncated(tok):
    text = "a" * 150
    rows = tokenize_row({"text": text}, tok, _entry(), CFG, "f.jsonl", 0)
    assert [len(r["input_ids"]) for r in rows] == [64, 64, 23]  # 150 bytes + EOS
    assert all(r["labels"] == r["input_ids"] for r in rows)


def test_completion_masks_prompt_unless_train_on_inputs(tok):
    row = {"prompt": "Q: 2+2?\nA:", "completion": " 4"}
    (r,) = tokenize_row(row, tok, _entry(type="completion"), CFG, "f.jsonl", 0)
    n_prompt = len("Q: 2+2?\nA:")
    assert r["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert r["labels"][n_prompt:] == r["input_ids"][n_prompt:]
    assert r["input_ids"][-1] == tok.eos_token_id
    (r2,) = tokenize_row(row, tok, _entry(type="completion"), CFG.changed(train_on_inputs=True), "f.jsonl", 0)
    assert r2["labels"] == r2["input_ids"]


def test_messages_train_only_assistant_tokens(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]
    (r,) = tokenize_row({"messages": msgs}, tok, _entry(type="messages"), CFG.changed(sequence_len=256), "f.jsonl", 0)
    trained = tok.decode([t for t, l in zip(r["input_ids"], r["labels"]) if l != IGNORE_INDEX])
    assert "hello!" in trained and "hi" not in trained.replace("hello", "") and "be brief" not in trained


@pytest.mark.parametrize(
    "row,entry,pattern",
    [
        ({"txt": "x"}, _entry(), r"data\.jsonl: row 7: missing field 'text'"),
        ({"prompt": "x", "completion": 3}, _entry(type="completion"), r"row 7: field 'completion' should be str, got int"),
        ({"messages": [{"role": "user"}]}, _entry(type="messages"), r"row 7: message 0 should be"),
    ],
)
def test_malformed_row_names_file_and_row(tok, row, entry, pattern):
    with pytest.raises(DataError, match=pattern):
        tokenize_row(row, tok, entry, CFG, "data.jsonl", 7)


def test_packing_restarts_positions_and_masks_boundaries():
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}, {"input_ids": [6, 7, 8, 9], "labels": [6, 7, 8, 9]}]
    packed = list(pack_rows(rows, 6, pad_token_id=0))
    assert packed[0]["input_ids"] == [1, 2, 3, 4, 5, 0]
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1, 0]
    assert packed[0]["labels"] == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5, IGNORE_INDEX]
    assert packed[1]["input_ids"][:4] == [6, 7, 8, 9] and len(packed[1]["input_ids"]) == 6


def _recipe_data(tmp_path, rows, kind="completion", **data):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    raw = {**TINY_RECIPE, "data": {"datasets": [{"path": str(f), "type": kind}], "sequence_len": 64, **data}}
    return validate_recipe(raw).data, f


def test_build_datasets_from_jsonl_with_heldout(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(40)]
    data, _ = _recipe_data(tmp_path, rows, val_set_size=0.25)
    train, held = build_datasets(data, tok, str(tmp_path / "cache"))
    assert len(train) == 30 and len(held) == 10
    assert set(train.column_names) == {"input_ids", "labels"}


def test_invalid_json_line_is_named(tmp_path, tok):
    data, f = _recipe_data(tmp_path, [json.dumps({"prompt": "a", "completion": "b"}), "{not json"])
    with pytest.raises(DataError, match=r"d\.jsonl: row 1 \(line 2\) is not valid JSON"):
        build_datasets(data, tok, str(tmp_path / "cache"))


def test_malformed_row_in_file_is_named(tmp_path, tok):
    data, f = _recipe_data(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"d\.jsonl: row 2: field 'completion' is null or missing in this row"):
        build_datasets(data, tok, str(tmp_path / "cache"))


def test_csv_and_text_files(tmp_path, tok):
    (tmp_path / "t.csv").write_text("prompt,completion\nhello,world\nfoo,bar\n")
    (tmp_path / "doc.txt").write_text("plain text document\n" * 10)
    raw = {**TINY_RECIPE, "data": {"datasets": [{"path": str(tmp_path / "t.csv"), "type": "completion"}, {"path": str(tmp_path / "doc.txt")}], "sequence_len": 64}}
    train, held = build_datasets(validate_recipe(raw).data, tok, str(tmp_path / "cache"))
    assert held is None and len(train) == 2 + 4  # 2 csv rows; 201 text bytes + EOS in 64-token chunks


def test_streaming_yields_rows(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    raw = {**TINY_RECIPE, "data": {"datasets": [{"path": str(f), "type": "completion"}], "sequence_len": 64, "streaming": True},
           "train": {**TINY_RECIPE["train"], "max_steps": 2}}
    train, _ = build_datasets(validate_recipe(raw).data, tok, str(tmp_path / "cache"))
    got = list(train)
    assert len(got) == 10 and all(r["input_ids"][-1] == tok.eos_token_id for r in got)


@pytest.mark.slow
def test_python_stdlib_split_is_deterministic(tmp_path):
    from neutrain.data import python_stdlib_corpus

    a = python_stdlib_corpus(str(tmp_path / "a"))
    b = python_stdlib_corpus(str(tmp_path / "b"))
    assert open(a).read() == open(b).read()
    rows = [json.loads(line) for line in open(a)]
    held = sum(r["heldout"] for r in rows)
    assert len(rows) > 200 and 0.01 < held / len(rows) < 0.15  # about 5% of files held out


def test_python_stdlib_small_pick_keeps_a_heldout_file(tmp_path):
    from neutrain.data import python_stdlib_corpus

    rows = [json.loads(line) for line in open(python_stdlib_corpus(str(tmp_path), max_files=6))]
    assert len(rows) == 6 and sum(r["heldout"] for r in rows) == 1
    assert len({r["file"].split("/")[0] for r in rows}) > 3, "the pick should spread over the library"
