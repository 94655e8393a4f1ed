"""The kinds of a GGUF file's metadata values that a reader acts on: one table, checked as the header is read.

Why: a GGUF file types each value itself (a u32, a string, an array of strings), and the readers behind neutrain
(transformers' config and tokenizer builders) take the value they find for a key as the kind they expect. A
``llama.block_count`` stored as the string ``"two"``, a float or an array, a ``tokenizer.ggml.bos_token_id`` as a
string, a ``tokenizer.chat_template`` as a number, ``tokenizer.ggml.token_type`` as strings or ``merges`` as numbers
each ended in a traceback from inside transformers or Jinja (``StrictDataclassFieldValidationError``, ``TypeError:
Can't compile non template nodes``, ``'int' object is not iterable``); a ``token_type`` array shorter than the
vocabulary loaded and generated with the other tokens' types unknown, exit 0. :data:`KINDS` names, for each key a
reader acts on, the kind of value it must hold; :func:`check_metadata` refuses the first that does not, in one line
naming the file, the key, what it holds and what it must. The values' ranges are the model-config table's
(:mod:`neutrain.config.model_values`), applied to the config built from them.

Example:
    >>> check_metadata("GGUF file 'm.gguf'", {"llama.block_count": "two"}, {"llama.block_count": (8, None)},
    ...                ValueError)
    Traceback (most recent call last):
    ValueError: GGUF file 'm.gguf': metadata 'llama.block_count' is a string ('two'); expected an integer
"""

from __future__ import annotations

import re
from typing import Any

_INTEGERS = {0, 1, 2, 3, 4, 5, 10, 11}  # u8 i8 u16 i16 u32 i32 u64 i64
_FLOATS = {6, 12}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_WORDS = {**{k: "an integer" for k in _INTEGERS}, **{k: "a number" for k in _FLOATS}, _BOOL: "a boolean",
          _STRING: "a string", _ARRAY: "an array"}

_ARCH = r"[^.]+\."
# (key pattern, kind): the pattern matches the whole key.
KINDS: tuple[tuple[str, str], ...] = (
    (r"general\.architecture", "string"),
    (_ARCH + r"(context_length|embedding_length|block_count|vocab_size|expert_count|expert_used_count|"
     r"rope\.dimension_count|attention\.key_length|attention\.value_length|attention\.sliding_window|"
     r"expert_feed_forward_length|expert_shared_count|leading_dense_block_count)", "integer"),
    # Per-layer in some architectures (OpenELM): an integer, or one per layer.
    (_ARCH + r"(feed_forward_length|attention\.head_count|attention\.head_count_kv)", "integers"),
    (_ARCH + r"(attention\.layer_norm_rms_epsilon|attention\.layer_norm_epsilon|rope\.freq_base|"
     r"rope\.scaling\.factor|rope\.scaling\.original_context_length|attn_logit_softcapping|"
     r"final_logit_softcapping|logit_scale)", "number"),
    (_ARCH + r"rope\.scaling\.type", "string"),
    (r"tokenizer\.ggml\.(model|pre)|tokenizer\.chat_template(\..+)?", "string"),
    (r"tokenizer\.ggml\.tokens", "strings"),
    (r"tokenizer\.ggml\.merges", "merges"),
    (r"tokenizer\.ggml\.token_type", "per-token integers"),
    (r"tokenizer\.ggml\.scores", "per-token numbers"),
    (r"tokenizer\.ggml\.(bos|eos|eot|eom|unknown|padding|seperator|separator|cls|mask)_token_id", "integer"),
    (r"tokenizer\.ggml\.add_(bos|eos|space_prefix)_token|tokenizer\.ggml\.add_space_prefix", "boolean"),
)
_COMPILED = tuple((re.compile(pattern), kind) for pattern, kind in KINDS)
_EXPECTED = {"string": "a string", "integer": "an integer", "integers": "an integer or an array of integers",
             "number": "a number", "boolean": "a boolean", "strings": "an array of strings",
             "merges": "an array of strings, each two tokens and one space between them ('a b')",
             "per-token integers": "an array of integers, one per token of tokenizer.ggml.tokens",
             "per-token numbers": "an array of numbers, one per token of tokenizer.ggml.tokens"}


def _kind_of(key: str) -> str | None:
    return next((kind for pattern, kind in _COMPILED if pattern.fullmatch(key)), None)


def _holds(kind: str, code: int, inner: int | None, value: Any, tokens: int | None) -> bool:
    if kind == "string":
        return code == _STRING
    if kind == "integer":
        return code in _INTEGERS
    if kind == "integers":
        return code in _INTEGERS or (code == _ARRAY and inner in _INTEGERS)
    if kind == "number":
        return code in _INTEGERS or code in _FLOATS
    if kind == "boolean":
        return code == _BOOL
    if kind in ("strings", "merges"):
        if code != _ARRAY or inner != _STRING:
            return False
        return kind == "strings" or all(m.count(" ") == 1 and m[0] != " " and m[-1] != " " for m in value)
    allowed = _INTEGERS if kind == "per-token integers" else _INTEGERS | _FLOATS
    return code == _ARRAY and inner in allowed and (tokens is None or len(value) == tokens)


def _shown(code: int, inner: int | None, value: Any) -> str:
    if code == _ARRAY:
        return f"an array of {len(value):,} {_WORDS.get(inner, f'type-{inner}').split(' ', 1)[-1]} values"
    text = repr(value)
    return f"{_WORDS.get(code, f'of type {code}')} ({text if len(text) <= 40 else text[:37] + '...'})"


def check_metadata(label: str, metadata: dict[str, Any], kinds: dict[str, tuple[int, int | None]],
                   error: type[Exception]) -> None:
    """Refuse the first key of :data:`KINDS` whose value is not of its kind (keys the table does not name are
    left to their readers).

    Args:
        label: Names the file, first in the message.
        metadata: Key -> value, as :class:`~neutrain.storage.gguf_header.GGUFIndex` holds them.
        kinds: Key -> ``(value type, element type or None)``, the file's own type codes.
        error: The error class raised.
    """
    tokens = metadata.get("tokenizer.ggml.tokens")
    count = len(tokens) if kinds.get("tokenizer.ggml.tokens", (None, None)) == (_ARRAY, _STRING) else None
    for key, value in metadata.items():
        kind = _kind_of(key)
        if kind is None:
            continue
        code, inner = kinds[key]
        if not _holds(kind, code, inner, value, count):
            raise error(f"{label}: metadata '{key}' is {_shown(code, inner, value)}; expected {_EXPECTED[kind]}"
                        + (f" ({count:,})" if kind.startswith("per-token") and count is not None else ""))
