"""Every place neutrain touches transformers where releases differ or an API is private, one adapter each.

neutrain supports transformers 5.17 (the GPU image) up to the newest 5.x (``pyproject.toml``:
``transformers>=5.17,<6``). Each adapter's docstring says which releases need it and when it can go;
``tests/unit/compat/`` fails first when a release moves. The other transformers adapters, by topic:
:mod:`~neutrain.compat.trainer_hooks` (``TrainingArguments`` drift, the checkpoint directory seam),
:mod:`~neutrain.compat.static_cache` (``StaticCache`` for the decode engine),
:mod:`~neutrain.compat.masks` (the packed-sequence probe), :mod:`~neutrain.compat.gguf_tensors`
(GGUF tensors one at a time) and :mod:`~neutrain.compat.quiet` (progress bars and warnings).

Example:
    >>> from neutrain.compat.transformers_api import cache_forward_kwarg
    >>> class Model:
    ...     def forward(self, input_ids, past_key_values=None): ...
    >>> cache_forward_kwarg(Model())
    'past_key_values'
"""

from __future__ import annotations

import inspect
from typing import Any

# --- Trainer internals (trainer) ---


def rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Delete old ``checkpoint-N`` directories beyond ``save_total_limit``.

    transformers >= 5.2x has a module-level ``trainer_utils.rotate_checkpoints``;
    older 5.x releases have the ``Trainer._rotate_checkpoints`` method.

    Needed while 5.17 is supported; the method's branch can go with it.
    """
    try:
        from transformers.trainer_utils import rotate_checkpoints as _rotate
    except ImportError:
        _rotate = None
    if _rotate is not None:
        _rotate(
            output_dir=run_dir,
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=False,
        )
    else:  # pragma: no cover - exercised on older transformers only
        trainer._rotate_checkpoints(use_mtime=False, output_dir=run_dir)


def checkpointing_training_args(enabled: bool) -> dict:
    """``TrainingArguments`` keywords that turn non-reentrant activation checkpointing on or off.

    transformers 5.2x renamed ``gradient_checkpointing[_kwargs]`` to
    ``activation_checkpointing[_kwargs]`` (the old names warn); 5.17 knows only the
    old ones. Non-reentrant checkpointing is required for compressed weights and
    fused updates: the reentrant variant runs backward in a nested graph and can
    read weights that the fused update has already changed.

    Needed while 5.17 is supported; can go (pass the ``activation_checkpointing`` names) once the
    oldest supported release has them.
    """
    from transformers import TrainingArguments

    params = inspect.signature(TrainingArguments.__init__).parameters
    prefix = "activation_checkpointing" if "activation_checkpointing" in params else "gradient_checkpointing"
    return {prefix: enabled, f"{prefix}_kwargs": {"use_reentrant": False} if enabled else None}


def use_one_gpu_per_process(args) -> bool:
    """Stop ``Trainer`` from wrapping the model in ``nn.DataParallel`` on a multi-GPU host; True if it would have.

    A single process that sees several GPUs gets ``args.n_gpu > 1`` and the Trainer's
    ``DataParallel`` wrap. Fused updates need one process per GPU (``accelerate launch
    --num_processes N``). ``TrainingArguments`` has no public switch; ``_n_gpu`` is the value
    ``n_gpu`` reports in every 4.x/5.x release.

    Private in every release: stays until ``TrainingArguments`` has a public switch.
    """
    if args.n_gpu <= 1:
        return False
    args._n_gpu = 1
    return True


# --- KV cache API (eval) ---
# Drift handled here (see docs/kvcache.md §3.2): the forward keyword
# for the cache is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the old
# name only warns there); model outputs carry ``past_key_values`` or ``cache``;
# attention modules receive the cache as ``past_key_values=`` or ``cache=``.
# Needed while releases before 5.24 are supported; once the oldest is 5.24, the three
# answer ``cache`` alone and can go.


def cache_forward_kwarg(model: Any) -> str:
    """Name of the keyword a model's ``forward`` takes its KV cache under.

    Example:
        >>> # model(input_ids, **{cache_forward_kwarg(model): cache}, use_cache=True)
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The cache object a forward pass returned, whatever the attribute is called."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def cache_from_module_kwargs(kwargs: dict) -> Any:
    """The cache an attention module was called with (``cache=`` or ``past_key_values=``)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def register_attention_with_sdpa_mask(name: str, attention_fn: Any) -> None:
    """Register ``attention_fn`` as attention implementation ``name``, masked like SDPA.

    Without the mask registration transformers passes ``attention_mask=None`` to
    custom implementations, which would silently drop causality in prefill.

    Not a version difference: every release needs both registrations; kept here as the one place
    that touches transformers' attention and mask registries.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention() -> Any:
    """transformers' SDPA attention function (same import path in every 5.x).

    ``transformers.integrations`` is not a public API: stays here, so a move is one line to change.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def set_attn_implementation(model: Any, name: str) -> None:
    """Switch a loaded model's attention implementation (method in 5.x, config attribute before).

    The config-attribute branch serves 4.x only, which neutrain no longer supports: it can go.
    """
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - old transformers
        model.config._attn_implementation = name


# --- KV cache surgery (speculative) ---
# Drift handled here: transformers 5.x keeps a DynamicCache as
# ``cache.layers[l].keys/.values`` ([B, H, S, D]); 4.x kept ``key_cache`` and
# ``value_cache`` lists. Speculative decoding re-indexes these tensors to keep the
# accepted path of a token tree, pick one draft row, or crop rejected drafts.
# The 4.x branch can go: neutrain supports 5.x only.


def _map_cache_tensors(cache: Any, fn: Any) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.numel() == 0:
                continue
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        return
    for name in ("key_cache", "value_cache"):  # pragma: no cover - transformers 4.x layout
        tensors = getattr(cache, name)
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                tensors[i] = fn(t)


def cache_keep_positions(cache: Any, positions: Any) -> None:
    """Keep only sequence ``positions`` (a sorted LongTensor) in every layer, in place."""
    _map_cache_tensors(cache, lambda t: t.index_select(-2, positions.to(t.device)))


def cache_crop_to(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of every layer, in place."""
    _map_cache_tensors(cache, lambda t: t[..., :length, :])


def cache_select_row(cache: Any, row: int) -> None:
    """Keep batch row ``row`` only (the batch becomes 1), in place."""
    _map_cache_tensors(cache, lambda t: t[row : row + 1])


def cache_repeat_rows(cache: Any, repeats: int) -> None:
    """Repeat a batch-1 cache ``repeats`` times along the batch dimension, in place."""
    _map_cache_tensors(cache, lambda t: t.expand(repeats, *t.shape[1:]).contiguous())


def cache_batch_size(cache: Any) -> int:
    """Batch size of a cache's tensors (1 when empty)."""
    sizes: list[int] = []
    _map_cache_tensors(cache, lambda t: sizes.append(t.shape[0]) or t)
    return sizes[0] if sizes else 1


# --- Checkpoint key conversions (nn.load: per-expert checkpoints into fused 3-D experts) ---


def weight_conversions(model: Any) -> tuple[list, list]:
    """transformers' load-time ``(renamings, converters)`` for ``model`` (5.x ``conversion_mapping``).

    Converters merge checkpoint tensors into one parameter (MoE experts stored one by one
    become ``experts.gate_up_proj`` / ``experts.down_proj``); renamings rename keys.
    Same API in 5.17 and 5.24. Private (``conversion_mapping``, ``core_model_loading``), as are the two
    functions below: they stay, and are checked again with each release.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model) or []
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def rename_checkpoint_key(key: str, renamings: list, converters: list, base_model_prefix: str | None,
                          model_keys: dict) -> tuple[str, str | None]:
    """transformers' renaming of one checkpoint key: ``(model key, matched converter pattern or None)``."""
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, base_model_prefix, model_keys)


def natural_key_order(keys: list[str]) -> list[str]:
    """Checkpoint keys in the order transformers feeds converters (``experts.2`` before ``experts.10``)."""
    from transformers.core_model_loading import dot_natural_key

    return sorted(keys, key=dot_natural_key)


# --- GGUF checkpoints (modeling) ---


def gguf_dequantized_kwargs() -> dict:
    """``from_pretrained`` keywords that load a GGUF file as a plain dense model.

    Why: transformers 5.17 and 5.24 attach a ``GgufHfQuantizer`` to a model loaded with only
    ``gguf_file=`` (5.24 even keeps quantized weights packed when a matmul kernel is installed), and
    ``save_pretrained`` then refuses the model. ``GgufConfig(dequantize=True)`` loads every tensor
    dequantized and leaves no quantizer; releases without ``GgufConfig`` always dequantized.

    Needed by 5.17 and 5.24; can go once a GGUF load leaves no quantizer on its model.
    """
    try:
        from transformers import GgufConfig
    except ImportError:  # pragma: no cover - older transformers dequantize GGUF files unconditionally
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:  # pragma: no cover
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def gguf_special_tokens(metadata) -> dict[str, int]:
    """``{"bos_token": id, "eos_token": id, ...}`` as a GGUF file's metadata (its parsed header's) declares them.

    Why: transformers 5.17 builds the tokenizer of a ``gpt2``-type GGUF vocabulary (Llama 3, SmolLM,
    Qwen 2) with ``eos_token`` set to the BOS token, so a fine-tuned model would be taught to stop on
    the wrong token; 5.24 reads them right. The ids are read from the file's metadata and set on the
    tokenizer (:func:`neutrain.nn.gguf.load_gguf_tokenizer`) on every version.

    Needed while 5.17 is supported; can go with it.

    Example:
        >>> gguf_special_tokens({"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
        {'bos_token': 1, 'eos_token': 2}
    """
    out: dict[str, int] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = int(value)
    return out
