"""Which tokenizers ``check_vocabulary`` lets through: ids that can reach the embedding must be inside it."""

from types import SimpleNamespace

import pytest

from neutrain.cli.checkpoints import check_vocabulary
from neutrain.data import byte_tokenizer
from neutrain.errors import UserInputError


def _model(vocab):
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab))


def test_a_special_token_past_the_vocabulary_that_no_input_holds_is_allowed():
    # transformers' GGUF conversion appends an <|endoftext|> the file's model does not have
    tok = byte_tokenizer()
    vocab = len(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    assert len(tok) == vocab + 1
    check_vocabulary(_model(vocab), tok, "model.tokenizer")


@pytest.mark.parametrize("added", [{"eos_token": "<|new-eos|>"}, {"pad_token": "<|new-pad|>"}])
def test_a_pad_or_eos_token_past_the_vocabulary_is_refused(added):
    tok = byte_tokenizer()
    vocab = len(tok)
    tok.add_special_tokens(added)
    with pytest.raises(UserInputError, match=f"the model's vocabulary {vocab}"):
        check_vocabulary(_model(vocab), tok, "model.tokenizer")


def test_a_text_token_past_the_vocabulary_is_refused():
    tok = byte_tokenizer()
    vocab = len(tok)
    tok.add_tokens(["neutrain"])  # not special: text can produce it
    with pytest.raises(UserInputError, match="token ids from"):
        check_vocabulary(_model(vocab), tok, "generate")
