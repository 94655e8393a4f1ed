"""The model-config values a build uses, each with the range it must have: one table, for every config.

Why a table: a config's values reach the model unchecked wherever they come from. A recipe's
``model.config`` was checked key by key against its class's defaults, but a foreign model's
``config.json`` or a GGUF file's metadata (``llama.attention.layer_norm_rms_epsilon``) was trusted: an
``rms_norm_eps`` of 0, a negative ``rope_theta`` or a NaN ``initializer_range`` built a model that
trained or generated NaN in silence. :data:`RULES` names each value a build reads (sizes, counts,
epsilons, rotary bases and factors, dropouts, caps) and :func:`check_config_values` holds any mapping
to it: the recipe's ``model.config`` and ``distill.draft_config`` at load
(:mod:`neutrain.config.model_config`), and every config a model is built from, the foreign ones
included (``neutrain.nn.load.build``). A value outside its rule is one line naming where it came from,
the key and the value; any non-finite number anywhere in the config is refused the same way.

Example:
    >>> check_config_values({"hidden_size": 64, "rms_norm_eps": 0.0}, "model.config", ValueError)
    Traceback (most recent call last):
    ValueError: model.config.rms_norm_eps: 0.0 must be a finite number from 1.2e-38 (float32's smallest normal number) to below 1 (a norm's epsilon)
"""

from __future__ import annotations

import math
import re
from typing import Any

_SIZE_MAX = 2**31 - 1
"""Largest size or count (int32 indexing; a larger one is a corrupt value, not a model)."""

_SMALLEST_EPSILON = 1.2e-38
"""float32's smallest normal number: an epsilon under it is 0, or a subnormal, in the weights' dtype."""

# (key pattern, kind, words): the pattern must match the whole key, at any depth (rope_scaling.factor).
RULES: tuple[tuple[str, str, str], ...] = (
    (r"vocab_size|hidden_size|n_embd|d_model|embed_dim|intermediate_size|n_inner|ffn_dim|"
     r"(moe|shared_expert)_intermediate_size|num_hidden_layers|n_layers?|num_layers|num_attention_heads|n_heads?|"
     r"num_key_value_heads|n_kv_heads|"
     r"max_position_embeddings|n_positions|n_ctx|original_max_position_embeddings|num_(local_)?experts|"
     r"n_routed_experts|num_experts_per_tok|n_shared_experts", "size", "a size or count"),
    (r"head_dim|(qk_(nope|rope)_|v_)head_dim|(kv|q)_lora_rank|sliding_window|attention_chunk_size", "size0", "a size (0: derived, or off)"),
    (r"\w*norm_eps|\w*norm_epsilon|rms_eps", "epsilon", "a norm's epsilon"),
    (r"rope_theta|rope_local_base_freq|factor|(low|high)_freq_factor|beta_(fast|slow)|attention_factor",
     "positive", "a rotary embedding's base or factor"),
    (r"partial_rotary_factor", "fraction", "the part of a head the rotary embedding turns"),
    (r"torch_dtype|dtype", "dtype", "the weights' dtype"),
    (r"\w*(attn|final|attention)_logit_softcapping|logit_scale|embedding_multiplier|residual_multiplier|"
     r"attention_multiplier|logits_scaling", "positive", "a scale or cap"),
    # ESM's token_dropout is a switch named like a probability; true is no dropout of 1 anywhere else.
    (r"(?!token_dropout$)\w*dropout\w*|\w*_pdrop", "probability", "a dropout probability"),
    (r"initializer_range|\w*_init_std", "non-negative", "the random init's standard deviation"),
    (r"tie_word_embeddings|attention_bias|mlp_bias|use_cache", "boolean", "a switch"),
    # A token id is a whole number (a list of them for several end tokens); -1 is the "none" some configs write.
    # Whether it indexes the vocabulary is check_config_relations' (it needs vocab_size).
    (r"(bos|eos|pad|sep|unk|mask|cls|decoder_start|forced_bos|forced_eos)_token_id", "token", "a token id"),
)
# The values of a generation_config.json that a generation reads (transformers' model.generate merges them in):
# checked with RULES, for the token ids, by check_generation_values.
GENERATION_RULES: tuple[tuple[str, str, str], ...] = (
    (r"max_length|max_new_tokens|num_beams|num_return_sequences|num_beam_groups", "size",
     "a length or count of a generation"),
    (r"min_length|min_new_tokens|top_k|no_repeat_ngram_size|encoder_no_repeat_ngram_size", "size0",
     "a length or count of a generation (0: none)"),
    (r"temperature|diversity_penalty|penalty_alpha|epsilon_cutoff|eta_cutoff", "non-negative",
     "a sampling setting"),
    (r"top_p|typical_p|min_p", "fraction", "a probability mass to sample from"),
    (r"repetition_penalty|encoder_repetition_penalty", "positive", "a penalty that divides logits"),
    (r"do_sample|use_cache|renormalize_logits|remove_invalid_values", "boolean", "a switch"),
)
_COMPILED = tuple((re.compile(pattern), kind, words) for pattern, kind, words in RULES)
_GENERATION_COMPILED = tuple((re.compile(pattern), kind, words) for pattern, kind, words in GENERATION_RULES) + _COMPILED


def _rule_of(key: str, compiled=_COMPILED) -> tuple[str, str] | None:
    return next(((kind, words) for pattern, kind, words in compiled if pattern.fullmatch(key)), None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _problem(kind: str, value: Any) -> str | None:
    """Why ``value`` breaks rule ``kind`` (None when it keeps it; None is left to the config class's default)."""
    if value is None:
        return None
    if kind == "boolean":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "token":  # its range, the vocabulary's, is check_config_relations'
        whole = _number(value) and math.isfinite(value) and float(value).is_integer()
        return None if whole and abs(value) <= _SIZE_MAX else "must be a whole number"
    if kind in ("size", "size0"):
        low = 1 if kind == "size" else 0
        whole = _number(value) and math.isfinite(value) and float(value).is_integer()
        return None if whole and low <= value <= _SIZE_MAX else f"must be a whole number from {low} to {_SIZE_MAX:,}"
    if kind == "dtype":  # a name torch has (float32, bfloat16, ...); a number or a list failed inside transformers
        import torch  # lazy: the table itself imports nothing heavy

        return None if isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None),
                                                               torch.dtype) else "must name a torch dtype (e.g. bfloat16)"
    if not _number(value) or not math.isfinite(value):
        return "must be a finite number"
    if kind == "epsilon" and not _SMALLEST_EPSILON <= value < 1:  # below it, float32 holds 0: rsqrt(0) is inf
        return f"must be a finite number from {_SMALLEST_EPSILON} (float32's smallest normal number) to below 1"
    if kind == "fraction" and not 0 < value <= 1:
        return "must be a finite number > 0 and at most 1"
    if kind == "positive" and not value > 0:
        return "must be a finite number > 0"
    if kind == "probability" and not 0 <= value < 1:  # 1 drops every activation: the layer's output is zeros
        return "must be a finite number from 0 to below 1"
    if kind == "non-negative" and not value >= 0:
        return "must be a finite number >= 0"
    return None


def check_config_values(values: dict, where: str, error: type[Exception], keys: list[str] | None = None,
                        compiled=_COMPILED) -> None:
    """Refuse a config whose values break :data:`RULES`, or that holds a non-finite number anywhere.

    Args:
        values: The config as a mapping (``config.to_dict()``, a ``config.json``, a recipe's ``model.config``).
        where: What it is, first in every message (``model.config``, ``GGUF file 'x.gguf'``).
        error: The error class to raise (a recipe's or a checkpoint's).
        keys: Only these top-level keys (and what they hold) are checked; None: every key.

    Raises:
        error: ``"<where>.<key>: <value> <rule> (<what the key is>)"``.
    """
    stack = [(f"{where}.{key}", key, values[key]) for key in (values if keys is None else keys) if key in values]
    while stack:
        at, key, value = stack.pop()
        if key in ROTARY_KEYS and at.count(".") == where.count(".") + 1:
            check_rotary_scaling(value, at, error)
        if isinstance(value, dict):
            stack.extend((f"{at}.{k}", str(k), v) for k, v in value.items())
            continue
        if isinstance(value, (list, tuple)):  # per-layer values, rope_scaling's long_factor, end tokens: each element
            token = (_rule_of(key, compiled) or ("",))[0] == "token"
            stack.extend((f"{at}[{i}]", key, v) for i, v in enumerate(value)
                         if token or _number(v) or isinstance(v, dict))
            continue
        rule = _rule_of(key, compiled)
        # NaN is no setting anywhere; inf is one for a few (Mamba's time_step_limit), not for a ruled key.
        if isinstance(value, float) and (math.isnan(value) or (rule is not None and math.isinf(value))):
            raise error(f"{at}: {value} is not a finite number" + (f" ({rule[1]})" if rule else ""))
        if rule is None:
            continue
        problem = _problem(rule[0], value)
        if problem is not None:
            raise error(f"{at}: {value!r} {problem} ({rule[1]})")
    if keys is None or any(key in _RELATED for key in keys):
        check_config_relations(values, where, error)


ROTARY_KEYS = ("rope_parameters", "rope_scaling")
"""The structured keys of a rotary embedding's scaling: a mapping naming its ``rope_type``, or null."""


_ROTARY_BASE = frozenset({"rope_theta", "partial_rotary_factor"})
"""The keys a rotary mapping may hold without naming a ``rope_type``: the base of the default rotation."""


def rotary_parts(value: Any) -> list:
    """The scaling mappings ``value`` holds: itself, or per layer type (Gemma 3: ``{"full_attention": {...}}``)."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return [(f".{k}", v) for k, v in value.items()]
    return [("", value)]


def check_rotary_scaling(value: Any, at: str, error: type[Exception]) -> None:
    """``rope_scaling``/``rope_parameters`` is null or a mapping (per layer type, mappings) each naming its
    ``rope_type`` (or the older ``type``) as a non-empty string.

    Why: ``rope_scaling: ""`` (or ``[]``, ``0``, ``{}``) was accepted and trained with no scaling at all; the config
    classes take a value they do not read as none.

    Example:
        >>> check_rotary_scaling("", "model.config.rope_scaling", ValueError)
        Traceback (most recent call last):
        ValueError: model.config.rope_scaling: '' must be a mapping naming its rope_type (e.g. {rope_type: linear, factor: 2.0}), or null
    """
    if value is None:
        return
    for suffix, part in rotary_parts(value):
        if not isinstance(part, dict):
            raise error(f"{at}{suffix}: {part!r} must be a mapping naming its rope_type (e.g. {{rope_type: linear, "
                        "factor: 2.0}), or null")
        kind = part.get("rope_type", part.get("type"))
        if kind is None and part and set(part) <= _ROTARY_BASE:
            continue  # the base alone (transformers 5's rope_parameters: {rope_theta: ...}): no scaling, "default"
        if not isinstance(kind, str) or not kind.strip():
            raise error(f"{at}{suffix}.rope_type: {kind!r} must name the rotary scaling (default, linear, dynamic, "
                        "yarn, longrope, llama3, ...)")


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")
_RELATED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor",
            "vocab_size", *_TOKEN_IDS)


def _whole(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and float(value).is_integer() and value > 0


def check_config_relations(values: dict, where: str, error: type[Exception]) -> None:
    """Refuse values that each keep their own rule but not each other's: the build would fail on them with a
    tensor-shape ``RuntimeError`` deep in the first forward, or use them in silence.

    * ``num_attention_heads`` must be a multiple of ``num_key_value_heads`` (each key/value head serves a
      whole group of query heads);
    * without a ``head_dim`` of its own, ``hidden_size`` must be a multiple of ``num_attention_heads`` (each
      head takes an equal slice of it);
    * with rotary embeddings (any ``rope*`` key), the rotated part of a head must have an even width (the
      rotation pairs its dimensions);
    * every special-token id (``bos``, ``eos``, ``pad``, ...) must index the vocabulary (an ``eos`` past it
      never ends a generation; ``pad_token_id: -1`` is kept as the "none" some configs write).

    Example:
        >>> check_config_relations({"num_attention_heads": 4, "num_key_value_heads": 3}, "model.config", ValueError)
        Traceback (most recent call last):
        ValueError: model.config.num_key_value_heads: 3 does not divide num_attention_heads 4 (each key/value head serves a whole group of query heads)
    """
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if _whole(heads) and _whole(kv) and heads % kv:
        raise error(f"{where}.num_key_value_heads: {kv} does not divide num_attention_heads {heads} (each key/value "
                    "head serves a whole group of query heads)")
    head_dim, hidden = values.get("head_dim"), values.get("hidden_size")
    if head_dim is None and _whole(hidden) and _whole(heads) and hidden % heads:
        raise error(f"{where}.hidden_size: {hidden} is not a multiple of num_attention_heads {heads} (each head "
                    "takes an equal slice of it; or give head_dim)")
    width = head_dim if _whole(head_dim) else hidden // heads if _whole(hidden) and _whole(heads) else None
    factor = values.get("partial_rotary_factor", 1.0)
    if width and any(k.startswith("rope") for k in values) and _number(factor) and 0 < factor <= 1:
        rotated = int(width * factor)
        if rotated % 2:
            key = "head_dim" if _whole(head_dim) else "hidden_size"
            raise error(f"{where}.{key}: a head {width} wide rotates {rotated} dimensions, an odd number (rotary "
                        "embeddings turn the dimensions in pairs)")
    vocab = values.get("vocab_size")
    for key in _TOKEN_IDS:
        ids = values.get(key)
        for token in ids if isinstance(ids, (list, tuple)) else [ids]:
            if token is None or isinstance(token, bool) or not isinstance(token, int):
                continue
            if key == "pad_token_id" and token == -1:
                continue
            if token < 0 or (_whole(vocab) and token >= vocab):
                bound = f"from 0 to {vocab - 1:,}, as vocab_size is {vocab:,}" if _whole(vocab) else "0 or more"
                raise error(f"{where}.{key}: {token} is not a token of the vocabulary (an id is {bound})")


def check_generation_values(values: dict, where: str, error: type[Exception], vocab_size: Any) -> None:
    """Refuse a generation config (a model folder's ``generation_config.json``) whose values break
    :data:`GENERATION_RULES` or :data:`RULES`, or whose token ids do not index the model's vocabulary.

    Why: transformers merges these into every ``model.generate`` (the sample printed after a run, a model no
    engine serves): ``eos_token_id: "x"`` loaded, then failed deep in a generation after all the training;
    ``top_p: 5`` or a negative ``repetition_penalty`` sampled from something else than the model.

    Example:
        >>> check_generation_values({"eos_token_id": "x"}, "generation_config.json", ValueError, 64)
        Traceback (most recent call last):
        ValueError: generation_config.json.eos_token_id: 'x' must be a whole number (a token id)
    """
    check_config_values({key: value for key, value in values.items() if key != "vocab_size"}, where, error,
                        compiled=_GENERATION_COMPILED)
    ids = {key: values[key] for key in _TOKEN_IDS if values.get(key) is not None}
    if ids:
        check_config_relations({**ids, "vocab_size": vocab_size}, where, error)
