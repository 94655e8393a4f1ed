"""Tokenizers that need no download: byte-level, or BPE trained on the spot.

Why: the default recipe must run on a fresh machine with no network, so it
cannot fetch a tokenizer. ``byte`` maps every UTF-8 byte to a token (vocab 259);
``train-bpe`` trains a byte-level BPE on the recipe's own training text, which
takes seconds and shortens sequences about 3x. Both come back as a
``PreTrainedTokenizerFast`` with a chat template, and are saved with every
checkpoint and export so inference sees the same vocabulary.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

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


LONGEST_WORD = 256
"""Characters of one run of whitespace, or of anything else, that the BPE trainer sees at a time (longer runs
are cut)."""


def bounded_words(texts: Iterable[str], longest: int = LONGEST_WORD) -> Iterator[str]:
    """``texts``, each run of more than ``longest`` non-space characters, or of more than ``longest`` whitespace
    characters, cut into pieces of ``longest``.

    Why: the BPE trainer's work grows faster than linearly with the length of one word (each merge rescans
    it): a single 1 MB word ran past 170 s, far below the 16 MiB line bound. The byte-level pre-tokenizer
    makes a run of whitespace one word too (``\\s+``), so a 1 MB run of spaces hung the trainer the same way
    once words without spaces were cut. Real words and indents are far shorter, so their counts, and the
    vocabulary learnt from them, are unchanged.

    Example:
        >>> list(bounded_words(["a " + "x" * 10 + " b"], longest=4))
        ['a ', 'xxxx', 'xxxx', 'xx', ' b']
        >>> list(bounded_words(["a" + " " * 9 + "b"], longest=4))
        ['a', '    ', '    ', ' ', 'b']
    """
    long_run = re.compile(r"\S{%d,}|\s{%d,}" % (longest + 1, longest + 1))
    for text in texts:
        start = 0
        for run in long_run.finditer(text):
            if run.start() > start:
                yield text[start:run.start()]
            yield from (run.group()[i:i + longest] for i in range(0, len(run.group()), longest))
            start = run.end()
        if start == 0:
            yield text
        elif start < len(text):
            yield text[start:]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Train a byte-level BPE tokenizer on ``texts`` (long runs without whitespace cut: :func:`bounded_words`).

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
    tok.train_from_iterator(bounded_words(texts), trainer=trainer)
    return _wrap(tok)
