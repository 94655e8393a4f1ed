"""Where a recipe's model and tokenizer names are found: a local directory, or the local Hugging Face cache.

Why: neutrain reads models from disk only and never downloads one. A ``model.base_model`` hub id that
was not in the cache used to reach transformers, which (with a network configured but unreachable)
retried the hub 40 times over 99 s and then blamed ``model.tokenizer``, a key the user had not set.
:func:`check_model_names` answers before anything is imported: it looks in the cache the way
``HF_HUB_OFFLINE=1`` does (a file lookup, never a network call) and names the key that holds the name.

Example:
    >>> from neutrain.config.sections import ModelSection
    >>> check_model_names(ModelSection(init="random", config={"model_type": "llama"}, tokenizer="byte"))
    >>> try:
    ...     check_model_names(ModelSection(base_model="someone/not-downloaded"))
    ... except RecipeError as e:
    ...     print(str(e)[:80])
    model.base_model: 'someone/not-downloaded' is not a local directory and not in t
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from neutrain.errors import RecipeError
from neutrain.files import check_folder, check_kind

BUILT_TOKENIZERS = ("byte", "train-bpe")
"""``model.tokenizer`` values neutrain builds itself (nothing to find)."""

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")

if TYPE_CHECKING:  # the sections' module reads none of this one
    from neutrain.config.sections import ModelSection


def hub_cache_dir() -> str:
    """The Hugging Face hub cache this process reads (``HF_HUB_CACHE``, ``HF_HOME``/hub, or the default)."""
    from huggingface_hub import constants  # lazy: a module of constants, no network client

    return constants.HF_HUB_CACHE


def in_hub_cache(repo_id: str, files: tuple[str, ...]) -> bool:
    """Whether the local cache holds one of ``files`` of hub repository ``repo_id`` (its ``main`` revision).

    A file lookup only, as ``HF_HUB_OFFLINE=1`` does it: never a network call.
    """
    from huggingface_hub import try_to_load_from_cache  # lazy: reads the cache's folders only

    for name in files:
        try:
            found = try_to_load_from_cache(repo_id, name)
        except ValueError:  # not a valid repo id (huggingface_hub's HFValidationError is a ValueError)
            return False
        if isinstance(found, str):
            return True
    return False


def find_model_name(key: str, name: str, files: tuple[str, ...]) -> None:
    """Refuse ``name`` (the value of recipe ``key``) unless it is a local directory or a hub id in the cache.

    Raises:
        RecipeError: one line naming ``key``, the name, where it was looked for and what to do.
    """
    local = Path(name).expanduser()
    if local.is_dir():
        if not any((local / file).is_file() for file in files):  # else transformers fails later, with a traceback
            raise RecipeError(f"{key}: the directory '{name}' holds no {' or '.join(files)}: it is not a Hugging Face "
                              f"{'tokenizer' if files == TOKENIZER_FILES else 'model'} directory")
        check_folder(local, f"{key}: '{name}'", RecipeError)  # no FIFO or device where transformers will read
        return
    if os.path.lexists(local):  # a file, a FIFO, a device: named as what it is
        check_kind(local, f"{key}: '{name}'", RecipeError, want="dir")
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if looks_like_path or not _REPO_ID.fullmatch(name):
        raise RecipeError(f"{key}: '{name}' does not exist (relative to the current directory {Path.cwd()})")
    if in_hub_cache(name, files):
        return
    raise RecipeError(f"{key}: '{name}' is not a local directory and not in the local Hugging Face cache "
                      f"({hub_cache_dir()}); neutrain never downloads a model: fetch it first "
                      f"(`hf download {name}`) or give a local directory")


def check_model_names(model: ModelSection) -> None:
    """Each model or tokenizer name the recipe's ``model`` section will read is on this machine.

    ``model.base_model`` is read for the weights (``init: pretrained``), the config (no ``model.config``)
    or the tokenizer (no ``model.tokenizer``); beside ``model.gguf_file`` it is the directory or hub repo
    holding that file; named but read for none of these, it must still be a model on this machine. ``model.tokenizer``
    is read unless neutrain builds it (``byte``, ``train-bpe``).
    """
    base, tokenizer, gguf = model.base_model, model.tokenizer, model.gguf_file
    reads_base = model.init == "pretrained" or model.config is None or tokenizer is None
    if base and reads_base:
        if gguf and not Path(base).expanduser().is_dir():
            find_model_name("model.base_model", base, (gguf,))
        elif not gguf:
            find_model_name("model.base_model", base, MODEL_FILES if model.init == "pretrained"
                            or model.config is None else TOKENIZER_FILES)
    if tokenizer and tokenizer not in BUILT_TOKENIZERS:
        find_model_name("model.tokenizer", tokenizer, TOKENIZER_FILES)
    if base and not reads_base:
        # Nothing reads it, yet a recipe that names a model is taken to mean that model: /dev/zero, a FIFO or a
        # folder of something else beside init: random trained a random model under the base's name, and the
        # recipe beside the checkpoints went on naming a path no one could load.
        find_model_name("model.base_model", base, (gguf,) if gguf else MODEL_FILES + TOKENIZER_FILES)
