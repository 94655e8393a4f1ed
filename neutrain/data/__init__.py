"""Data: local files -> tokenised, masked, optionally packed training rows.

Example:
    >>> import tempfile
    >>> from neutrain.config import load_recipe
    >>> from neutrain.data import build_datasets, byte_tokenizer
    >>> recipe = load_recipe("default")
    >>> with tempfile.TemporaryDirectory() as cache:
    ...     train, heldout = build_datasets(recipe.data, byte_tokenizer(), cache_dir=cache)
    >>> len(train) > 0 and len(heldout) > 0
    True
"""

from __future__ import annotations

from typing import Any

from neutrain.data.checks import STAT_COLUMNS, check_counts, check_split, check_stream, counts_of, require_tokens, tokenize_counted
from neutrain.data.formats import IGNORE_INDEX
from neutrain.data.packing import Collator, pack_rows, pad_token_id
from neutrain.data.sources import load_rows, python_stdlib_corpus, quiet_datasets, stream_from
from neutrain.data.tokenizer import byte_tokenizer, train_bpe_tokenizer
from neutrain.errors import RecipeError

__all__ = [
    "IGNORE_INDEX", "Collator", "build_datasets", "byte_tokenizer", "iter_training_texts", "load_rows",
    "pack_rows", "pad_token_id", "python_stdlib_corpus", "train_bpe_tokenizer",
]

_TOKEN_COLUMNS = ("input_ids", "labels")


def _source_name(entry: dict) -> str:
    return entry["path"]


def _tokenize(ds, entry: dict, tokenizer, data_cfg: Any):
    source = _source_name(entry)

    def fn(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "heldout", *STAT_COLUMNS)}
        keys = list(batch)
        for j, index in enumerate(indices):
            row = {k: batch[k][j] for k in keys}
            heldout = bool(row.get("heldout", False))
            rows, tokens, cut = tokenize_counted(row, tokenizer, entry, data_cfg, source, index)
            for k, r in enumerate(rows):
                out["input_ids"].append(r["input_ids"])
                out["labels"].append(r["labels"])
                out["heldout"].append(heldout)
                # What the raw row trains, for checks.counts_of (carried by its first tokenised row).
                out["_first"].append(k == 0)
                out["_row_tokens"].append(tokens)
                out["_cut"].append(cut)
        return out

    import datasets

    columns = list(ds.column_names) if ds.column_names is not None else None
    extra = {"desc": f"tokenising {source}"} if isinstance(ds, datasets.Dataset) else {}  # progress bar
    return ds.map(fn, batched=True, with_indices=True, remove_columns=columns, **extra)


def iter_training_texts(data_cfg: Any, cache_dir: str, limit_chars: int = 20_000_000):
    """Yield raw training text (for training a tokenizer on the recipe's own data)."""
    seen = 0
    for entry in data_cfg.datasets:
        if entry["split"] != "train":
            continue
        for row in load_rows(entry, streaming=True, cache_dir=cache_dir):
            if row.get("heldout"):
                continue
            if entry["type"] == "text":
                texts = [row.get(entry["text_field"]) or ""]
            elif entry["type"] == "completion":
                texts = [row.get(entry["prompt_field"]) or "", row.get(entry["completion_field"]) or ""]
            else:
                texts = [m.get("content", "") for m in row.get(entry["messages_field"]) or [] if isinstance(m, dict)]
            for t in texts:
                if isinstance(t, str) and t:
                    seen += len(t)
                    yield t
            if seen >= limit_chars:
                return


def build_datasets(data_cfg: Any, tokenizer, cache_dir: str):
    """Build the training and held-out datasets described by a recipe's ``data`` section.

    Args:
        data_cfg: The validated ``data`` section (``neutrain.config.sections.DataSection``, read by attribute; typed
            ``Any`` here because the data package does not import the config package).
        tokenizer: A Hugging Face tokenizer (with ``eos_token_id``; ``pad_token_id`` for packing).
        cache_dir: The run's cache: generated corpora and ``datasets``' tables are written there, never in the
            user-wide cache another process may be writing (:func:`~neutrain.data.sources.datasets_cache`).

    Returns:
        ``(train, heldout)``: ``datasets`` objects whose rows have ``input_ids``, ``labels``
        (and ``position_ids`` when packed). ``heldout`` is ``None`` when there is none.
    """
    import datasets

    seed = data_cfg.shuffle_seed
    streaming = data_cfg.streaming
    train_parts, eval_parts = [], []
    for entry in data_cfg.datasets:
        raw = load_rows(entry, streaming=streaming, cache_dir=cache_dir)
        if streaming:
            check_stream(raw, tokenizer, entry, data_cfg, _source_name(entry))
        ds = _tokenize(raw, entry, tokenizer, data_cfg)
        if not streaming:
            check_counts(counts_of(ds, len(raw)), raw, tokenizer, entry, data_cfg, _source_name(entry))
        if streaming:
            ds = ds.shuffle(seed=seed, buffer_size=10_000)
            if data_cfg.max_samples:
                ds = ds.take(data_cfg.max_samples)
            (eval_parts if entry["split"] == "validation" else train_parts).append(ds.filter(lambda r: not r["heldout"]))
            continue
        if entry["split"] == "validation":
            eval_parts.append(ds)
            continue
        with quiet_datasets():
            held = ds.filter(lambda r: r["heldout"])
            ds = ds.filter(lambda r: not r["heldout"])
        if len(held):
            eval_parts.append(held)
        ds = ds.shuffle(seed=seed)
        if data_cfg.max_samples:
            ds = ds.select(range(min(len(ds), data_cfg.max_samples)))
        train_parts.append(ds)
    if not train_parts:
        raise RecipeError("data.datasets: no dataset with split 'train'")
    concat = datasets.interleave_datasets if streaming else datasets.concatenate_datasets
    train = concat(train_parts) if len(train_parts) > 1 else train_parts[0]
    heldout = concat(eval_parts) if len(eval_parts) > 1 else (eval_parts[0] if eval_parts else None)
    if heldout is None and data_cfg.val_set_size > 0 and not streaming:
        check_split(len(train), data_cfg.val_set_size)
        split = train.train_test_split(test_size=data_cfg.val_set_size, seed=seed)
        train, heldout = split["train"], split["test"]
    if not streaming:
        require_tokens(train, "training data")
        require_tokens(heldout, "held-out data")
    train = _finish(train, data_cfg, tokenizer, streaming, cache_dir)
    heldout = _finish(heldout, data_cfg, tokenizer, streaming, cache_dir) if heldout is not None else None
    return train, heldout


def _finish(ds, data_cfg: Any, tokenizer, streaming: bool, cache_dir: str):
    ds = ds.remove_columns(["heldout", *STAT_COLUMNS])
    if not data_cfg.sample_packing:
        return ds
    import datasets

    pad = pad_token_id(tokenizer)
    n = data_cfg.sequence_len
    if streaming:
        return stream_from(lambda: pack_rows(iter(ds), n, pad), cache_dir)
    return datasets.Dataset.from_list(list(pack_rows(ds, n, pad)))
