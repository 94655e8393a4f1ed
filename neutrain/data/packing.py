"""Sequence packing and the batch collator.

Packing puts several examples into one row of exactly ``sequence_len`` tokens.
Each document's ``position_ids`` restart at 0. Rows carry no attention mask:
transformers (5.x) then detects the packed documents from the position ids and
builds a block-diagonal causal mask (when no KV cache is built: the Trainer sets
``config.use_cache = False``), so documents never attend to each other,
and attention kernels that support packing (``neutrain_sage``) see the same
boundaries. The first label of each document is -100, so no token is trained
to predict across a boundary.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from neutrain.data.formats import IGNORE_INDEX


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (padding is never trained)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pack_rows(rows: Iterable[dict], sequence_len: int, pad_token_id: int) -> Iterator[dict]:
    """Greedily pack tokenised rows into rows of exactly ``sequence_len`` tokens.

    Example:
        >>> rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
        >>> next(pack_rows(rows, 6, 0))["position_ids"]
        [0, 1, 2, 0, 1, 0]
    """
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for row in rows:
        r_ids, r_labels = row["input_ids"][:sequence_len], row["labels"][:sequence_len]
        if len(ids) + len(r_ids) > sequence_len and ids:
            yield _pad(ids, labels, pos, sequence_len, pad_token_id)
            ids, labels, pos = [], [], []
        ids += r_ids
        labels += [IGNORE_INDEX] + list(r_labels[1:])
        pos += list(range(len(r_ids)))
    if ids:
        yield _pad(ids, labels, pos, sequence_len, pad_token_id)


def _pad(ids, labels, pos, n, pad_id):
    fill = n - len(ids)
    # Padding is one more "document" whose labels are ignored.
    return {
        "input_ids": ids + [pad_id] * fill,
        "labels": labels + [IGNORE_INDEX] * fill,
        "position_ids": pos + list(range(fill)),
    }


class Collator:
    """Pads a list of rows into a batch.

    Rows without ``position_ids`` get right padding and an ``attention_mask``;
    packed rows already have equal length and are stacked as they are.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if all("position_ids" in r for r in rows) and len({len(r["input_ids"]) for r in rows}) == 1:
            return {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
        n = max(len(r["input_ids"]) for r in rows)
        batch = {
            "input_ids": torch.full((len(rows), n), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(rows), n), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), n), dtype=torch.long),
        }
        for i, r in enumerate(rows):
            m = len(r["input_ids"])
            batch["input_ids"][i, :m] = torch.tensor(r["input_ids"])
            batch["labels"][i, :m] = torch.tensor(r["labels"])
            batch["attention_mask"][i, :m] = 1
        return batch
