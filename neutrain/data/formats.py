"""Turning raw rows into ``input_ids`` and ``labels``, per data format.

Formats (``data.datasets[i].type``):

* ``text``: every token is trained; long documents are cut into rows of
  ``sequence_len`` rather than truncated, so no text is wasted.
* ``completion``: a prompt and a completion; prompt labels are -100 unless
  ``train_on_inputs``.
* ``messages``: a list of ``{role, content}`` rendered with the tokenizer's chat
  template; only the roles in ``roles_to_train`` (default: assistant) are
  trained, found from character offsets so any template works.

Text is text: a special token's string in the data (``<|pad|>``, ``<|eos|>``, ``<|im_end|>``) is
tokenised as the characters it is made of, never as the control token (a dataset of pad strings
trained nothing). Only a chat template's own markers become special tokens.

A malformed row raises :class:`DataError` naming the file and the row. Every
tokenised row also says whether it was ``truncated`` at ``sequence_len``, so the
data checks (:mod:`neutrain.data.checks`) can report how much was cut.
"""

from __future__ import annotations

import logging
from typing import Any

from neutrain.compat.native_panics import native_panics
from neutrain.data.chat import describe_template_error, tokenizer_panic
from neutrain.data.template_bounds import TemplateCostError, bounded_rendering
from neutrain.errors import DataError

logger = logging.getLogger("neutrain")

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython", "function"})
"""Roles chat templates commonly render (OpenAI's, Llama 3's, Qwen's and Mistral's messages)."""

_WARNED_ROLES: set[tuple[str, str]] = set()  # (source, role) already named: once per file, not once per row


def _name_unknown_roles(messages: list, roles_to_train, source: str, index: int) -> None:
    """A role no chat template knows and ``data.roles_to_train`` does not list is rendered by the template and
    never trained: a misspelt ``asistant`` would train nothing of its replies without a word. Named once a file."""
    for m in messages:
        role = m["role"]
        if role in CHAT_ROLES or role in roles_to_train or (source, role) in _WARNED_ROLES:
            continue
        _WARNED_ROLES.add((source, role))
        logger.warning("%s: row %d: role '%s' is neither a common chat role (%s) nor in data.roles_to_train (%s): "
                       "its messages are rendered by the chat template and not trained; list it in "
                       "data.roles_to_train to train it, or check its spelling", source, index, role,
                       ", ".join(sorted(CHAT_ROLES)), ", ".join(roles_to_train))

IGNORE_INDEX = -100


def _field(row: dict, name: str, kind: type, source: str, index: int) -> Any:
    if name in row and row[name] is None:
        # datasets gives a row that lacks a column other rows have the value None too: name both cases.
        raise DataError(f"{source}: row {index}: field '{name}' is null or missing in this row (other rows have it); "
                        f"expected {kind.__name__}")
    if name not in row or row[name] is None:
        raise DataError(f"{source}: row {index}: missing field '{name}' (columns present: {', '.join(map(str, row)) or 'none'})")
    value = row[name]
    if not isinstance(value, kind):
        raise DataError(f"{source}: row {index}: field '{name}' should be {kind.__name__}, got {type(value).__name__}")
    return value


def tokenize_text(row: dict, tokenizer, entry: dict, sequence_len: int, source: str, index: int) -> list[dict]:
    """One document -> one or more rows of at most ``sequence_len`` tokens, EOS-terminated."""
    text = _field(row, entry["text_field"], str, source, index)
    ids = as_text(tokenizer, text)
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    rows = []
    for start in range(0, len(ids), sequence_len):
        chunk = ids[start : start + sequence_len]
        if len(chunk) >= 2:  # a 1-token row trains nothing
            rows.append({"input_ids": chunk, "labels": list(chunk), "truncated": False})
    return rows


def tokenize_completion(row: dict, tokenizer, entry: dict, sequence_len: int, train_on_inputs: bool, source: str, index: int) -> list[dict]:
    """Prompt + completion -> one row; the prompt is masked unless ``train_on_inputs``."""
    prompt = _field(row, entry["prompt_field"], str, source, index)
    completion = _field(row, entry["completion_field"], str, source, index)
    p_ids = as_text(tokenizer, prompt)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False) else []
    c_ids = as_text(tokenizer, completion)
    if tokenizer.eos_token_id is not None:
        c_ids = c_ids + [tokenizer.eos_token_id]
    full = bos + p_ids + c_ids
    ids = full[:sequence_len]
    n_prompt = len(bos) + len(p_ids)
    labels = list(ids) if train_on_inputs else [IGNORE_INDEX] * min(n_prompt, len(ids)) + ids[n_prompt:]
    return [{"input_ids": ids, "labels": labels, "truncated": len(full) > sequence_len}]


def tokenize_messages(row: dict, tokenizer, entry: dict, sequence_len: int, train_on_inputs: bool, roles_to_train: list, source: str, index: int) -> list[dict]:
    """A conversation -> one row; tokens of untrained roles get label -100."""
    field = entry["messages_field"]
    lists = [k for k, v in row.items() if isinstance(v, list) and v and all(isinstance(m, dict) for m in v)]
    if row.get(field) is None and lists:  # e.g. ShareGPT's `conversations`: the key that maps it is messages_field
        raise DataError(f"{source}: row {index}: no field '{field}'; the conversation looks to be in '{lists[0]}': "
                        f"set messages_field: {lists[0]} in this dataset's entry")
    messages = _field(row, field, list, source, index)
    for j, m in enumerate(messages):
        if isinstance(m, dict) and "role" not in m and {"from", "value"} <= set(m):
            # ShareGPT keys: neutrain has no key mapping them, so say which rename makes the data readable.
            raise DataError(f"{source}: row {index}: message {j} has ShareGPT keys {{from, value}}; neutrain reads "
                            f"{{role, content}}: rename from -> role and value -> content, and list the replying role "
                            f"(e.g. gpt) in data.roles_to_train")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{source}: row {index}: message {j} should be {{role: str, content: str}}, got {m!r:.80}")
    _name_unknown_roles(messages, roles_to_train, source, index)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{source}: row {index}: type 'messages' needs a tokenizer with a chat template; this one has "
                        "none: set data.chat_template (e.g. chatml)")
    try:
        with bounded_rendering():  # every row under the template's bounds, not the probe alone
            spans, prev = _message_spans(tokenizer, messages, train_on_inputs, source, index)
    except TemplateCostError as exc:
        raise DataError(f"{source}: row {index}: the chat template {exc} on this row's messages (its cost depends "
                        "on their content); use a template that only formats the messages, or drop the row") from None
    except Exception as exc:
        line = describe_template_error(exc)
        if line is None:
            raise
        raise DataError(f"{source}: row {index}: {line}") from None
    enc = tokenizer(prev, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = _contents_as_text(tokenizer, prev, enc["input_ids"], enc["offset_mapping"], messages, spans,
                                     source, index)
    truncated = len(ids) > sequence_len
    ids, offsets = ids[:sequence_len], offsets[:sequence_len]
    labels = []
    for tok, (start, _end) in zip(ids, offsets):
        role = next((r for a, b, r in spans if a <= start < b), None)
        labels.append(tok if train_on_inputs or role in roles_to_train else IGNORE_INDEX)
    last_start, _, last_role = spans[-1]
    eos = tokenizer.eos_token_id
    if (eos is not None and not truncated and len(ids) < sequence_len and (train_on_inputs or last_role in roles_to_train)
            and eos not in [t for t, (a, _b) in zip(ids, offsets) if a >= last_start]):
        # The template closes the last reply with a marker that is not EOS (ChatML on a base model's
        # tokenizer): without an EOS to learn, the fine-tuned model would not stop generating.
        ids, labels = ids + [eos], labels + [eos]
    return [{"input_ids": ids, "labels": labels, "truncated": truncated}]


def as_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special token added, and none parsed from it: a special token's
    string in the text is tokenised as its characters.

    Example:
        >>> from neutrain.data import byte_tokenizer
        >>> tok = byte_tokenizer()
        >>> tok.pad_token_id in as_text(tok, "<|pad|>"), len(as_text(tok, "<|pad|>"))
        (False, 7)
    """
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _special_strings(tokenizer) -> set[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {*tokenizer.all_special_tokens, *(t.content for t in decoder.values() if getattr(t, "special", False))}


def _contents_as_text(tokenizer, text: str, ids: list[int], offsets: list, messages: list[dict], spans: list,
                      source: str, index: int) -> tuple[list[int], list]:
    """``ids``/``offsets`` of a rendered conversation, each special token that stands inside a message's content
    replaced by the tokens of its characters (the template's own markers are left as they are)."""
    specials = _special_strings(tokenizer)
    ranges = []
    for j, message in enumerate(messages):
        content = message["content"]
        if not any(special in content for special in specials):
            continue
        start = text.find(content, spans[j][0], spans[j][1]) if content else -1
        if start < 0:
            found = next(special for special in specials if special in content)
            raise DataError(f"{source}: row {index}: message {j} holds the special token string {found!r} as text, "
                            f"and the chat template changes the message text, so it cannot be kept as text; remove "
                            f"it from the data or use a template that writes the content as it is")
        ranges.append((start, start + len(content)))
    if not ranges:
        return list(ids), list(offsets)
    special_ids = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids(s) for s in specials}
    out_ids, out_offsets = [], []
    for tok, (a, b) in zip(ids, offsets):
        if tok in special_ids and any(lo <= a and b <= hi for lo, hi in ranges):
            pieces = as_text(tokenizer, text[a:b])
            out_ids += pieces
            out_offsets += [(a, b)] * len(pieces)
        else:
            out_ids.append(tok)
            out_offsets.append((a, b))
    return out_ids, out_offsets


def _message_spans(tokenizer, messages: list[dict], train_on_inputs: bool, source: str, index: int):
    """Character span and role of each message in the rendered conversation (from rendered prefixes), and the text."""
    spans, prev = [], ""
    for j in range(len(messages)):
        text_j = tokenizer.apply_chat_template(messages[: j + 1], tokenize=False)
        if not text_j.startswith(prev):
            raise DataError(f"{source}: row {index}: the chat template is not prefix-stable; cannot locate message {j}")
        start = len(prev)
        if messages[j]["role"] == "assistant" and j > 0 and not train_on_inputs:
            start = _assistant_content_start(tokenizer, messages[:j], start, text_j)
        spans.append((start, len(text_j), messages[j]["role"]))
        prev = text_j
    return spans, prev


def _assistant_content_start(tokenizer, before: list[dict], start: int, text: str) -> int:
    """Where an assistant reply's own text begins: after the header the generation prompt writes.

    The header (``<|im_start|>assistant\\n``) is what inference supplies; only the reply and its closing
    tokens are trained. A template whose generation prompt is not a prefix keeps the whole message.
    """
    header = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    return len(header) if text.startswith(header) and start <= len(header) < len(text) else start


def tokenize_row(row: dict, tokenizer, entry: dict, data_cfg: Any, source: str, index: int) -> list[dict]:
    """Dispatch on ``entry['type']``; returns zero or more tokenised rows.

    A panic of the tokenizer's native code on the row (a normalizer or pre-tokenizer regex past its
    backtracking limit) is a :class:`DataError` naming the row, without the panic's printout.
    """
    kind, n = entry["type"], data_cfg.sequence_len
    with native_panics(lambda message: DataError(tokenizer_panic(f"{source}: row {index}", message))):
        if kind == "text":
            return tokenize_text(row, tokenizer, entry, n, source, index)
        if kind == "completion":
            return tokenize_completion(row, tokenizer, entry, n, data_cfg.train_on_inputs, source, index)
        return tokenize_messages(row, tokenizer, entry, n, data_cfg.train_on_inputs, data_cfg.roles_to_train,
                                 source, index)

