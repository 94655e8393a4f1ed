"""Tokenizers that need no download: byte-level, or BPE trained on the spot.

Why: the default recipe must run on a fresh machine with no network, so it
cannot fetch a tokenizer. ``byte`` maps every UTF-8 byte to a token (vocab 259);
``train-bpe`` trains a byte-level BPE on the recipe's own training text, which
takes seconds and shortens sequences about 3x. Both come back as a
``PreTrainedTokenizerFast`` with a chat template, and are saved with every
checkpoint and export so inference sees the same vocabulary.
"""

from __future__ import annotations

from typing import Iterable

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
# A prefix-stable template: each message ends with EOS, which is what a model learns to stop on.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|bos|>{{ message['role'] }}\n{{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 3 specials), deterministic and download-free.

    Example:
        >>> tok = byte_tokenizer()
        >>> tok.decode(tok("héllo")["input_ids"])
        'héllo'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return _wrap(tok)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train a byte-level BPE tokenizer on ``texts``.

    Training is deterministic for the same texts in the same order, so every
    process of a distributed run builds the same vocabulary.

    Example:
        >>> tok = train_bpe_tokenizer(["def f(x):\\n    return x\\n"] * 10, vocab_size=300)
        >>> tok.eos_token
        '<|eos|>'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)
