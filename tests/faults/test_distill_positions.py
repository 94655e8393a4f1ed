"""The distillation's closing speculative decode is held to the target's positions when the recipe is loaded.

A run with ``distill.enabled`` trained, distilled, and then decoded a 32-token prompt plus ``distill.max_new_tokens``
(2,000) on a model of 256 positions in silence, and printed the draft's payoff measured on positions the model does
not have. Now ``32 + distill.max_new_tokens + distill.draft_len`` past ``max_position_embeddings`` is one line
naming ``distill.max_new_tokens`` and the largest value that fits, before anything is built.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.config.model_config import DISTILL_PROMPT_TOKENS
from tests.helpers import TINY_LLAMA, write_recipe

POSITIONS = TINY_LLAMA["max_position_embeddings"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return str(write_recipe(tmp_path_factory.mktemp("distill"), distill={"enabled": True}))


def _load(recipe, max_new_tokens, draft_len, enabled=True):
    from neutrain.config import load_recipe

    return load_recipe(recipe, [f"distill.enabled={str(enabled).lower()}", f"distill.max_new_tokens={max_new_tokens}",
                                f"distill.draft_len={draft_len}"])


@pytest.mark.parametrize("draft_len", [1, 4, 64])
def test_the_largest_decode_that_fits_is_taken_and_one_more_token_is_refused_naming_the_limit(recipe, draft_len):
    from neutrain.errors import RecipeError

    fits = POSITIONS - DISTILL_PROMPT_TOKENS - draft_len
    assert _load(recipe, fits, draft_len).distill.max_new_tokens == fits
    with pytest.raises(RecipeError, match=rf"^distill\.max_new_tokens: {POSITIONS + 1} tokens of the draft's speculative "
                                          rf"decode .* exceed model\.config\.max_position_embeddings {POSITIONS} .*"
                                          rf"set distill\.max_new_tokens to at most {fits}, "):
        _load(recipe, fits + 1, draft_len)
    assert _load(recipe, fits + 1, draft_len, enabled=False).distill.max_new_tokens == fits + 1  # no decode: no limit


@settings(max_examples=25, deadline=None)
@given(max_new_tokens=st.integers(1, 4 * POSITIONS), draft_len=st.integers(1, 64))
def test_any_decode_length_is_taken_exactly_when_it_fits(recipe, max_new_tokens, draft_len):
    from neutrain.errors import RecipeError

    fits = DISTILL_PROMPT_TOKENS + max_new_tokens + draft_len <= POSITIONS
    try:
        _load(recipe, max_new_tokens, draft_len)
        taken = True
    except RecipeError as exc:
        assert str(exc).startswith("distill.max_new_tokens: "), exc
        taken = False
    assert taken == fits
