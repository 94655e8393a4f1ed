"""Checks that every dataset trains something, made while it is tokenised, before training starts.

Why: a row whose labels are all -100 trains nothing, and a dataset of such rows
used to run to the end with exit 0 and an unchanged model. It happens with chat
roles outside ``roles_to_train`` (ShareGPT's ``human``/``gpt`` under the default
``[assistant]``), with prompts as long as ``sequence_len``, and with empty
documents. So each dataset entry is counted: no trainable token is a
:class:`DataError` naming the file and the cause; more than :data:`WARN_SHARE`
of its rows training nothing or cut at ``sequence_len`` is a logged warning
with the counts. A streamed dataset cannot be counted before training, so its
first :data:`PEEK_ROWS` rows are.

Example:
    >>> counts = Counts()
    >>> counts.add(tokens=0, truncated=False); counts.add(tokens=5, truncated=True)
    >>> (counts.rows, counts.trained, counts.truncated)
    (2, 1, 1)
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable

from neutrain.errors import DataError
from neutrain.data.formats import IGNORE_INDEX, as_text, tokenize_row

logger = logging.getLogger("neutrain.data")

WARN_SHARE = 0.10  # warn when more than 10% of a file's rows train no token or are truncated
PEEK_ROWS = 256  # rows of a streamed dataset checked before training
SAMPLE_ROWS = 1000  # raw rows read to explain an error (roles seen, prompt lengths)
STAT_COLUMNS = ("_first", "_row_tokens", "_cut")  # per tokenised row, dropped before training
_PROMPT_ROLES = {"system", "user", "human", "tool", "function", "developer"}


def trainable_tokens(labels: list[int]) -> int:
    """Labels a causal LM learns from: those not -100, after the first (no token precedes it).

    Example:
        >>> trainable_tokens([5, -100, 6, 7])
        2
    """
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def tokenize_counted(row: dict, tokenizer, entry: dict, data_cfg: Any, source: str, index: int) -> tuple[list[dict], int, bool]:
    """:func:`~neutrain.data.formats.tokenize_row` plus (trainable tokens, truncated) of the raw row."""
    rows = tokenize_row(row, tokenizer, entry, data_cfg, source, index)
    return rows, sum(trainable_tokens(r["labels"]) for r in rows), any(r["truncated"] for r in rows)


@dataclass
class Counts:
    """What one dataset entry trains, counted per raw row."""

    rows: int = 0  # raw rows read
    trained: int = 0  # rows with at least one trainable token
    truncated: int = 0  # trained rows cut at sequence_len
    tokens: int = 0  # trainable tokens

    def add(self, tokens: int, truncated: bool) -> None:
        self.rows += 1
        self.tokens += tokens
        if tokens:
            self.trained += 1
            self.truncated += bool(truncated)


def counts_of(ds, rows: int) -> Counts:
    """Counts of a tokenised ``datasets.Dataset`` (with :data:`STAT_COLUMNS`) made from ``rows`` raw rows."""
    counts = Counts(rows=rows)
    if len(ds) == 0 or STAT_COLUMNS[0] not in ds.column_names:  # every raw row was dropped
        return counts
    import pyarrow.compute as pc

    table = ds.select_columns(list(STAT_COLUMNS)).with_format("arrow")[:]
    first = table["_first"]  # one tokenised row per raw row carries that raw row's counts
    tokens = pc.filter(table["_row_tokens"], first)
    trained = pc.greater(tokens, 0)
    counts.tokens = int(pc.sum(tokens).as_py() or 0)
    counts.trained = int(pc.sum(pc.cast(trained, "int64")).as_py() or 0)
    counts.truncated = int(pc.sum(pc.cast(pc.and_(trained, pc.filter(table["_cut"], first)), "int64")).as_py() or 0)
    return counts


def has_tokens(ds) -> bool:
    """Whether any row of a tokenised ``datasets.Dataset`` (after splits and selection) trains a token."""
    if len(ds) == 0:
        return False
    import pyarrow.compute as pc

    return bool(pc.max(ds.select_columns(["_row_tokens"]).with_format("arrow")[:]["_row_tokens"]).as_py())


def check_stream(raw, tokenizer, entry: dict, data_cfg: Any, source: str) -> None:
    """Check the first :data:`PEEK_ROWS` rows of a streamed dataset (see :func:`check_counts`)."""
    sample = list(itertools.islice(iter(raw), PEEK_ROWS))
    counts = Counts()
    for index, row in enumerate(sample):
        counts.add(*tokenize_counted(row, tokenizer, entry, data_cfg, source, index)[1:])
    check_counts(counts, sample, tokenizer, entry, data_cfg, source, streamed=True)


def check_counts(counts: Counts, raw: Iterable[dict], tokenizer, entry: dict, data_cfg: Any, source: str, streamed: bool = False) -> None:
    """Raise :class:`DataError` when nothing trains; log a warning when many rows train nothing or are cut.

    Args:
        counts: The entry's counts.
        raw: Its raw rows, read (at most :data:`SAMPLE_ROWS`) only to explain an error.
        streamed: The counts cover only the first rows of a stream (the messages say so).
    """
    if counts.rows == 0:
        raise DataError(f"{source}: no rows (it is empty)")
    rows_word = f"{counts.rows} row{'s' if counts.rows != 1 else ''}"
    scope = f"the first {rows_word}" if streamed else f"its {rows_word}"
    if counts.tokens == 0:
        rows = list(itertools.islice(iter(raw), SAMPLE_ROWS))
        raise DataError(f"{source}: no token to train on in {scope}: {_why_untrained(rows, tokenizer, entry, data_cfg)}")
    untrained = counts.rows - counts.trained
    if untrained + counts.truncated > WARN_SHARE * counts.rows:
        logger.warning(
            "%s: of %s, %d train no token and %d were truncated at data.sequence_len=%d (%.0f%%, more than %.0f%%); "
            "check data.sequence_len%s", source, scope, untrained, counts.truncated, data_cfg.sequence_len,
            100 * (untrained + counts.truncated) / counts.rows, 100 * WARN_SHARE,
            " and data.roles_to_train" if entry["type"] == "messages" else "",
        )


def _why_untrained(rows: list[dict], tokenizer, entry: dict, data_cfg: Any) -> str:
    """The likely cause, in words, of a dataset that trains no token."""
    n = data_cfg.sequence_len
    if entry["type"] == "messages":
        field = entry["messages_field"]
        roles = sorted({m["role"] for r in rows for m in r.get(field) or [] if isinstance(m, dict) and isinstance(m.get("role"), str)})
        trained = [str(r) for r in data_cfg.roles_to_train]
        listed = f"roles seen: {', '.join(roles) or 'none'}; data.roles_to_train is [{', '.join(trained)}]"
        if set(roles) & set(trained):
            return f"{listed}, and every such turn starts at or after data.sequence_len={n} tokens: raise data.sequence_len"
        replies = [r for r in roles if r not in _PROMPT_ROLES]
        fix = f"set data.roles_to_train: [{', '.join(replies)}]" if replies else "add the replying role to data.roles_to_train"
        return f"{listed}: {fix}, or data.train_on_inputs: true"
    if entry["type"] == "completion":
        field = entry["prompt_field"]
        bos = 1 if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False) else 0
        lengths = [bos + len(as_text(tokenizer, r[field])) for r in rows if isinstance(r.get(field), str)]
        if lengths and min(lengths) >= n:
            return (f"every prompt is at least data.sequence_len={n} tokens long (prompts of {min(lengths)} to {max(lengths)} "
                    f"tokens), so no completion token fits: raise data.sequence_len or shorten the prompts")
        return "every completion is empty (and the tokenizer has no EOS token)"
    return "every document is empty or a single token (a row needs 2 tokens to train one)"


def check_split(n_rows: int, val_set_size: float) -> None:
    """Refuse a ``val_set_size`` split that would leave no training or no held-out row."""
    n_test, n_train = math.ceil(val_set_size * n_rows), math.floor((1 - val_set_size) * n_rows)
    if n_test < 1 or n_train < 1:
        raise DataError(f"data.val_set_size: {val_set_size} of {n_rows} training row(s) leaves {n_train} to train on and "
                        f"{n_test} held out; add data or set data.val_set_size: 0")


def require_tokens(ds: Any, what: str) -> None:
    """Raise :class:`DataError` when the assembled ``what`` (training or held-out data) trains no token."""
    if ds is not None and not has_tokens(ds):
        raise DataError(f"data: the {what} has no token to train on after data.max_samples and data.val_set_size "
                        f"picked its rows; most rows train nothing (see the warning above)")
