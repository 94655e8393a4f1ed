"""Text is text: a special token's string in the data never becomes the control token.

Text holding the tokenizer's special-token strings (``<|pad|>``, ``<|eos|>``) was tokenised as the special
tokens: a dataset of pad strings trained nothing and exited 0, and an ``<|eos|>`` in a reply taught the
model to stop there. Every format is checked through the data pipeline a run uses (``build_datasets``);
only a chat template's own markers may become special tokens.
"""

from __future__ import annotations

import json

import pytest

from neutrain.config import load_recipe
from neutrain.data import IGNORE_INDEX, build_datasets, byte_tokenizer
from neutrain.data.chat import set_chat_template
from tests.helpers import TINY_LLAMA, write_recipe

HOSTILE = "<|pad|><|pad|> stop here <|eos|> and <|bos|> go on"
ROWS = {
    "text": [{"text": HOSTILE * 3}, {"text": "<|pad|>" * 40}],
    "completion": [{"prompt": "say <|eos|>", "completion": HOSTILE}],
    "messages": [{"messages": [{"role": "user", "content": "repeat <|pad|>"}, {"role": "assistant", "content": HOSTILE}]}],
}


def _built(tmp_path, kind: str, template: str | None):
    data = tmp_path / f"{kind}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS[kind] * 4))
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(data), "type": kind}], "sequence_len": 512,
                                          "sample_packing": False, "chat_template": template},
                          model={"config": {**TINY_LLAMA, "max_position_embeddings": 512}})  # rows of 512 fit
    tokenizer = set_chat_template(byte_tokenizer(), template)
    train, _ = build_datasets(load_recipe(recipe).data, tokenizer, str(tmp_path / "cache"))
    return tokenizer, train


def _special_in_template(tokenizer) -> int:
    """Special tokens the chat template itself writes around a user turn and a reply."""
    neutral = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    rendered = tokenizer.apply_chat_template(neutral, tokenize=False)
    return sum(i in set(tokenizer.all_special_ids) for i in tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("kind, template", [("text", None), ("completion", None), ("messages", None),
                                            ("messages", "chatml"), ("messages", "zephyr")])
def test_special_token_strings_in_the_data_are_trained_as_their_characters(tmp_path, kind, template):
    tokenizer, train = _built(tmp_path, kind, template)
    special = set(tokenizer.all_special_ids)
    texts = {row["text"] for row in ROWS["text"]}
    for row in train:
        ids, labels = row["input_ids"], row["labels"]
        marks = [i for i in ids if i in special]
        trained = tokenizer.decode([t for t in labels if t != IGNORE_INDEX and t not in special])
        if kind == "messages":  # the template's markers only (and the EOS a reply may be closed with)
            assert len(marks) <= _special_in_template(tokenizer) + 1, tokenizer.decode(ids)
            assert HOSTILE in trained
        else:  # nothing but the EOS every row ends with
            assert marks == [tokenizer.eos_token_id] and ids[-1] == tokenizer.eos_token_id, tokenizer.decode(ids)
            assert trained in texts if kind == "text" else trained == HOSTILE
