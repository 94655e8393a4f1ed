"""A special-token id the recipe's ``model.config`` sets and the tokenizer replaces is said, not dropped in silence.

The build gives the model the tokenizer's ``pad``, ``bos`` and ``eos`` ids (the data and generation use them), so
``model.config.eos_token_id: 1000000000000`` trained with exit 0 and no word that the value was not used. The table
crosses each id with a value that differs from the tokenizer's (warned) and the tokenizer's own (quiet).
"""

from __future__ import annotations

import logging

import pytest

from neutrain.config.sections import ModelSection
from tests.helpers import TINY_LLAMA

KEYS = ["pad_token_id", "bos_token_id", "eos_token_id"]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("differs", [True, False])
def test_a_replaced_token_id_is_warned_about(caplog, key, differs):
    from neutrain.data import byte_tokenizer
    from neutrain.memory.model_config import recipe_config

    tok = byte_tokenizer()
    own = getattr(tok, key)
    value = 10**12 if differs else own
    model = ModelSection(init="random", tokenizer="byte", config={**TINY_LLAMA, key: value})
    with caplog.at_level(logging.WARNING, logger="neutrain"):
        config = recipe_config(model, tok)
    assert getattr(config, key) == own
    said = [r.getMessage() for r in caplog.records if "is replaced by the tokenizer" in r.getMessage()]
    if differs:
        assert len(said) == 1 and said[0].startswith(f"model.config.{key}: {value!r} is replaced"), said
    else:
        assert not said, said
