"""The transformers config a recipe's ``model`` section describes, built without torch's models or weights.

Why a module of its own: the memory planner (``neutrain estimate``, :mod:`neutrain.memory.fit`) needs
only the config, and :mod:`neutrain.trainer.modeling`, which builds models, imports torch, the codec
and every weight source at its top. transformers is imported when a config is built, and the GGUF
reader only for a recipe that names a GGUF file.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from neutrain.config.model_config import BYTE_VOCAB, plain_shape_config
from neutrain.errors import RecipeError
from neutrain.files import read_json_object

if TYPE_CHECKING:  # annotations only: the classes are not needed at run time
    from neutrain.config.sections import ModelSection

logger = logging.getLogger("neutrain")


def recipe_config(model_cfg: ModelSection, tokenizer):
    """The transformers config a recipe's ``model.config`` (or its base model's) describes, sized to
    ``tokenizer`` (a byte or trained vocabulary) and given its special token ids: what a random init builds.
    """
    from transformers import AutoConfig

    cfg = model_cfg.config
    if cfg is None and model_cfg.gguf_file:
        config = gguf_call(model_cfg, "gguf_config", trust_remote_code=model_cfg.trust_remote_code)
    elif cfg is None:
        config = AutoConfig.from_pretrained(model_cfg.base_model, trust_remote_code=model_cfg.trust_remote_code)
    else:
        if isinstance(cfg, str):
            cfg = read_json_object(cfg, f"model.config: file '{cfg}'", RecipeError)
        cfg = dict(cfg)
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise RecipeError("model.config: needs a 'model_type' (e.g. llama)")
        try:
            config = AutoConfig.for_model(model_type, **cfg)
        except ValueError as exc:
            raise RecipeError(f"model.config.model_type: {exc}") from None
    explicit_vocab = isinstance(model_cfg.config, dict) and "vocab_size" in model_cfg.config
    if model_cfg.tokenizer in ("byte", "train-bpe") and not explicit_vocab:
        config.vocab_size = len(tokenizer)
    if config.vocab_size < len(tokenizer):
        raise RecipeError(f"model.config.vocab_size: {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    given = model_cfg.config if isinstance(model_cfg.config, dict) else {}
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            if attr in given and given[attr] != value:
                # The tokenizer's id is the one the data and generation use; the recipe's was replaced in silence.
                logger.warning("model.config.%s: %r is replaced by the tokenizer's %s %r (the data and generation use "
                               "the tokenizer's); drop the key or make them agree", attr, given[attr], attr, value)
            setattr(config, attr, value)
    return config


def config_only(model_cfg: ModelSection):
    """The model config a recipe describes, without loading weights or a tokenizer (for the planner)."""
    from transformers import AutoConfig

    if model_cfg.config is None and model_cfg.gguf_file:
        return gguf_call(model_cfg, "gguf_config", trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.config is None:
        return AutoConfig.from_pretrained(model_cfg.base_model, trust_remote_code=model_cfg.trust_remote_code)

    class _Vocab:  # stands in for a tokenizer built at train time
        def __len__(self):
            return BYTE_VOCAB if model_cfg.tokenizer == "byte" else model_cfg.tokenizer_vocab_size

    return recipe_config(model_cfg, _Vocab())


def shape_config(model_cfg: ModelSection):
    """What the memory planner reads of the model's config (``ModelShape.from_config``): the recipe's own
    numbers where its mapping holds them all (:func:`~neutrain.config.model_config.plain_shape_config`, no
    transformers import), else the config :func:`config_only` builds."""
    return plain_shape_config(model_cfg) or config_only(model_cfg)


def gguf_call(model_cfg: ModelSection, function: str, *args, **kwargs):
    """Call ``neutrain.nn.gguf.<function>(source, name, ...)`` for the recipe's ``model.gguf_file``.

    Its errors (no ``gguf`` package, an unreadable file) become one :class:`RecipeError` naming the key.
    """
    from neutrain.nn import gguf  # lazy: torch and the codec, for a GGUF recipe only

    return gguf_errors(getattr(gguf, function), *gguf_source(model_cfg), *args, **kwargs)


def gguf_source(model_cfg: ModelSection) -> tuple[str, str]:
    """``(directory or hub id, file name)`` of the recipe's ``model.gguf_file``."""
    from neutrain.nn import gguf  # lazy: torch and the codec, for a GGUF recipe only

    return gguf.split_source(model_cfg.base_model, model_cfg.gguf_file)


def gguf_errors(function, *args, **kwargs):
    """``function(*args, **kwargs)``, a GGUF file it cannot read one :class:`RecipeError` naming ``model.gguf_file``."""
    from neutrain.nn import gguf  # lazy: torch and the codec, for a GGUF recipe only

    try:
        return function(*args, **kwargs)
    except gguf.GGUFLoadError as exc:
        raise RecipeError(f"model.gguf_file: {exc}") from None
