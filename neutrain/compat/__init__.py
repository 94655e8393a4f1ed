"""Every place where torch, transformers, accelerate or peft versions differ or a private API is touched.

neutrain supports the GPU image's transformers 5.17 / torch 2.11 and the newest
5.x / torch on PyPI. Library code never branches on versions and never reaches
into another library's internals itself; it calls a named adapter here, and each
adapter has a test in ``tests/unit/compat/`` that fails first when a release moves.

* this module: transformers' trainer rotation and checkpointing keywords, the KV-cache
  API, attention registration and SDPA routes;
* :mod:`neutrain.compat.trainer_hooks`: ``TrainingArguments`` drift and the
  ``Trainer._get_output_dir`` seam;
* :mod:`neutrain.compat.autograd`: "is a backward running?" (private torch API);
* :mod:`neutrain.compat.peft_lora`: peft's custom LoRA layer registry (private);
* :mod:`neutrain.compat.accelerate_prepare`: Accelerate's model preparation without DDP;
* :mod:`neutrain.compat.file_modes`: safetensors 0.8's ``0o600`` files given the umask's mode;
* :mod:`neutrain.compat.static_cache`: ``StaticCache``'s device-side length and CUDA-graph RNG
  (the decode engine);
* :mod:`neutrain.compat.chat_templates`: transformers' chat-template sandbox (private), which
  neutrain bounds before data is rendered with a template.
"""

from __future__ import annotations

import inspect
from typing import Any

# --- Trainer internals (trainer) ---


def rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Delete old ``checkpoint-N`` directories beyond ``save_total_limit``.

    transformers >= 5.2x has a module-level ``trainer_utils.rotate_checkpoints``;
    older 5.x releases have the ``Trainer._rotate_checkpoints`` method.
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
    """
    from transformers import TrainingArguments

    params = inspect.signature(TrainingArguments.__init__).parameters
    prefix = "activation_checkpointing" if "activation_checkpointing" in params else "gradient_checkpointing"
    return {prefix: enabled, f"{prefix}_kwargs": {"use_reentrant": False} if enabled else None}


# --- KV cache API (eval) ---
# Drift handled here (see docs/kvcache.md §3.2): the forward keyword
# for the cache is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the old
# name only warns there); model outputs carry ``past_key_values`` or ``cache``;
# attention modules receive the cache as ``past_key_values=`` or ``cache=``.


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
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention() -> Any:
    """transformers' SDPA attention function (same import path in every 5.x)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def set_attn_implementation(model: Any, name: str) -> None:
    """Switch a loaded model's attention implementation (method in 5.x, config attribute before)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - old transformers
        model.config._attn_implementation = name


# --- KV cache surgery (speculative) ---
# Drift handled here: transformers 5.x keeps a DynamicCache as
# ``cache.layers[l].keys/.values`` ([B, H, S, D]); 4.x kept ``key_cache`` and
# ``value_cache`` lists. Speculative decoding re-indexes these tensors to keep the
# accepted path of a token tree, pick one draft row, or crop rejected drafts.


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


def use_one_gpu_per_process(args) -> bool:
    """Stop ``Trainer`` from wrapping the model in ``nn.DataParallel`` on a multi-GPU host; True if it would have.

    A single process that sees several GPUs gets ``args.n_gpu > 1`` and the Trainer's
    ``DataParallel`` wrap. Fused updates need one process per GPU (``accelerate launch
    --num_processes N``). ``TrainingArguments`` has no public switch; ``_n_gpu`` is the value
    ``n_gpu`` reports in every 4.x/5.x release.
    """
    if args.n_gpu <= 1:
        return False
    args._n_gpu = 1
    return True


def sdpa_prefer_cudnn():
    """Context manager: SDPA tries cuDNN, then flash, efficient and math, in that order.

    torch >= 2.6 honours the order through ``sdpa_kernel(..., set_priority=True)``; older
    releases only restrict the set (their own order puts flash before cuDNN).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel(order)  # pragma: no cover - torch < 2.6


# --- Private SDPA backward ops (attention) ---
# SageAttention's "exact backward" route hands its quantized forward's O and log-sum-exp to
# the bf16 backward kernels that torch ships. Those ops are private (aten::_scaled_dot_product_*),
# and their argument lists and LSE layouts drift between releases: this adapter is the one
# place that knows them. Layouts (torch 2.11-2.13): flash LSE [B, H, N] fp32; cuDNN LSE
# [B, H, N, 1] fp32 (the non-ragged layout its forward allocates); CPU flash LSE [B, N, H]
# viewed as [B, H, N]. All are natural-log LSEs of the *scaled* scores.

#: Routes :func:`sdpa_backward` knows, fastest first on Hopper (measured: benchmarks/attention.py).
SDPA_BACKWARD_ROUTES = ("cudnn", "flash", "cpu")
_RNG_STATE: dict = {}


def _forward_rng_state(route: str, device, dtype):
    """The (philox seed, offset) tensors a dropout-free forward of ``route`` returns, from one tiny call
    per (route, device, dtype): the backward ops take them as they come (possibly empty/undefined)."""
    import torch

    key = (route, str(device), dtype)
    if key not in _RNG_STATE:
        x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
        if route == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False, scale=1.0)
        else:
            res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False, scale=1.0)
        _RNG_STATE[key] = (res[6], res[7])
    return _RNG_STATE[key]


def sdpa_backward(route: str, grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Exact bf16/fp16 attention backward through torch's private SDPA backward ops.

    Args:
        route: ``"cudnn"``, ``"flash"`` (CUDA) or ``"cpu"`` (torch's CPU flash kernel).
        grad_out, q, out: [B, H, N, D]; k, v: [B, H, N, D] (heads already expanded for GQA).
        lse: [B, H, N] fp32, natural-log log-sum-exp of ``scale * q.k`` per query row.
        causal: upper-left causal mask (q_len == kv_len).
        scale: the softmax scale.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q, k, v``.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.25)
        >>> dq, dk, dv = sdpa_backward("cpu", torch.ones_like(out), q, k, v, out, lse.transpose(1, 2), False, 0.25)
    """
    import torch

    aten = torch.ops.aten
    b, h, n, _ = q.shape
    if grad_out.stride() != out.stride():  # cuDNN builds its graph for one layout of O and dO
        grad_out = torch.empty_like(out).copy_(grad_out)
    lse = lse.float()
    # Dense (not varlen) calls: cumulative sequence lengths and the bias are undefined tensors
    # (None), as autograd passes them; the dropout RNG state is whatever the forward returns.
    if route == "cudnn":
        seed, offset = _forward_rng_state("cudnn", q.device, q.dtype)
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(b, h, n, 1).contiguous(), seed, offset, None, None, None,
            n, k.shape[2], 0.0, causal, scale=scale)
    if route == "flash":
        seed, offset = _forward_rng_state("flash", q.device, q.dtype)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, n, k.shape[2], 0.0, causal, seed, offset,
            scale=scale)
    if route == "cpu":
        # The CPU kernel keeps its LSE as [B, N, H] memory viewed as [B, H, N].
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.transpose(1, 2).contiguous().transpose(1, 2), 0.0, causal, scale=scale)
    raise ValueError(f"unknown SDPA backward route {route!r}; expected one of {SDPA_BACKWARD_ROUTES}")


# --- Checkpoint key conversions (nn.load: per-expert checkpoints into fused 3-D experts) ---


def weight_conversions(model: Any) -> tuple[list, list]:
    """transformers' load-time ``(renamings, converters)`` for ``model`` (5.x ``conversion_mapping``).

    Converters merge checkpoint tensors into one parameter (MoE experts stored one by one
    become ``experts.gate_up_proj`` / ``experts.down_proj``); renamings rename keys.
    Same API in 5.17 and 5.24.
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


# --- Autograd internals (nn.stack_views) ---


def saved_tensor_hooks_active() -> bool:
    """True while outer ``saved_tensors_hooks`` (e.g. activation checkpointing's) are installed.

    Reads torch's private hook stack (present since torch 2.1, as in 2.11 and 2.13); if that
    ever changes, answers True: callers then keep what they save (correct, more memory).
    """
    import torch

    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True


# --- GGUF checkpoints (modeling) ---


def gguf_dequantized_kwargs() -> dict:
    """``from_pretrained`` keywords that load a GGUF file as a plain dense model.

    Why: transformers 5.17 and 5.24 attach a ``GgufHfQuantizer`` to a model loaded with only
    ``gguf_file=`` (5.24 even keeps quantized weights packed when a matmul kernel is installed), and
    ``save_pretrained`` then refuses the model. ``GgufConfig(dequantize=True)`` loads every tensor
    dequantized and leaves no quantizer; releases without ``GgufConfig`` always dequantized.
    """
    try:
        from transformers import GgufConfig
    except ImportError:  # pragma: no cover - older transformers dequantize GGUF files unconditionally
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:  # pragma: no cover
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def gguf_special_tokens(path: str) -> dict[str, int]:
    """``{"bos_token": id, "eos_token": id, ...}`` as the GGUF file's metadata declares them.

    Why: transformers 5.17 builds the tokenizer of a ``gpt2``-type GGUF vocabulary (Llama 3, SmolLM,
    Qwen 2) with ``eos_token`` set to the BOS token, so a fine-tuned model would be taught to stop on
    the wrong token; 5.24 reads them right. The ids are read here with the ``gguf`` package and set on
    the tokenizer (:func:`neutrain.nn.gguf.load_gguf_tokenizer`) on every version.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out: dict[str, int] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            out[name] = int(field.parts[field.data[0]][0])
    return out
