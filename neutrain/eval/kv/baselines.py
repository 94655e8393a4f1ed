"""Baselines users already run, in neutrain's evaluation loop: transformers' ``QuantizedCache`` and kvpress presses.

Both are optional (``optimum-quanto`` or ``hqq`` for ``QuantizedCache``; ``kvpress`` for the presses).
Every entry point raises :class:`BaselineUnavailable` with a one-line reason when its package is missing
or does not import with the installed transformers, so a benchmark records the reason and goes on.

* :func:`quantized_cache_factory`: transformers' ``QuantizedCache`` (KIVI-style: 4-bit groups, a
  full-precision residual of the newest tokens), with ``stats()`` measuring the bytes it holds.
* :func:`press_cache_factory`: a kvpress press (SnapKV, StreamingLLM, ExpectedAttention) prunes the
  prompt's KV at prefill. kvpress's own pipeline then passes explicit ``position_ids`` to every decode
  step, because the pruned cache is shorter than the prompt; neutrain's loop passes none, so the cache
  here (:class:`PrunedCache`) reports the *logical* length (tokens seen), which makes the model place
  new tokens at the right RoPE positions, while masks are sized by the keys it really holds.

Both are registered caches (:mod:`neutrain.eval.kv.registry`): ``"quantized"`` and ``"kvpress:<press>"``, one
per press of :data:`PRESSES`, which ``kv_cache_factory`` makes as it makes any other.

Example:
    >>> with press_cache_factory(model, "snapkv", compression_ratio=0.75) as make:  # doctest: +SKIP
    ...     result = run_tasks(model, tok, samples, make)
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ... import compat

PRESSES = {"snapkv": "SnapKVPress", "streamingllm": "StreamingLLMPress", "expected_attention": "ExpectedAttentionPress"}


class BaselineUnavailable(RuntimeError):
    """An optional baseline's package is missing or does not work with the installed libraries."""


def _nbytes(t) -> int:
    """Bytes of a tensor, recursing into tensor subclasses (quanto's packed ``QTensor``: data, scale, shift)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    if hasattr(t, "W_q"):  # hqq keeps (codes, meta dict)
        return _nbytes(t.W_q) + sum(_nbytes(v) for v in getattr(t, "meta", {}).values() if torch.is_tensor(v))
    if isinstance(t, (tuple, list)):
        return sum(_nbytes(x) for x in t)
    if isinstance(t, dict):
        return sum(_nbytes(x) for x in t.values())
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


# ---------------------------------------------------------------- QuantizedCache
def _portable_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's own default ``unpack`` (codes of ``bits`` bits packed in uint8, lowest bits first)."""
    parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(parts).to(torch.uint8)


def _quanto_without_jit() -> list[str]:
    """Serve quanto's ``unpack`` from torch instead of its C++/CUDA extensions; returns the extensions stubbed.

    Why: the first ``unpack`` on a GPU JIT-compiles quanto's whole CUDA extension (its AWQ and Marlin GEMMs
    too) with nvcc, minutes of a time-limited run; a KV cache needs only ``unpack``, a few torch ops.
    """
    stubbed = []
    try:
        from optimum.quanto.library.extensions import get_extension
    except Exception:  # noqa: BLE001 - another quanto layout: leave it as it is
        return stubbed
    for name in ("quanto_cuda", "quanto_cpp"):
        try:
            ext = get_extension(name)
        except KeyError:
            continue
        if getattr(ext, "_lib", "absent") is None:
            ext._lib = SimpleNamespace(unpack=_portable_unpack)
            stubbed.append(name)
    return stubbed


def quantized_backend(preferred: tuple[str, ...] = ("quanto", "hqq")) -> str:
    """The first of ``preferred`` whose package imports (``optimum.quanto`` / ``hqq``); else BaselineUnavailable."""
    modules = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize"}
    errors = []
    for name in preferred:
        try:
            importlib.import_module(modules[name])
            if name == "quanto":
                _quanto_without_jit()
            return name
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason to record
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    raise BaselineUnavailable("QuantizedCache needs optimum-quanto or hqq (pip install optimum-quanto): "
                              + "; ".join(errors))


def _measured_quantized_cache_class():
    from transformers import QuantizedCache

    class MeasuredQuantizedCache(QuantizedCache):
        """transformers' ``QuantizedCache`` with ``stats()``: bytes it holds (codes, scales, residual) vs full."""

        def stats(self) -> dict:
            device = full = 0
            for layer in self.layers:
                if not getattr(layer, "is_initialized", False):
                    continue
                device += sum(_nbytes(getattr(layer, name, None)) for name in
                              ("_quantized_keys", "_quantized_values", "keys", "values"))
                ref = layer.keys  # the full-precision residual: empty right after a prefill
                quantized = getattr(layer, "_quantized_keys", None)
                b, h, _, d = ref.shape if ref.dim() == 4 else quantized.shape
                seen = getattr(layer, "cumulative_length", None) or ref.shape[-2]
                full += 2 * b * h * seen * d * ref.element_size()
            return {"device_bytes": device, "host_bytes": 0, "full_bytes": full,
                    "compression_ratio": full / device if device else float("nan")}

    return MeasuredQuantizedCache


@contextmanager
def quantized_cache_factory(model, backend: str | None = None, nbits: int = 4, group: int = 64, residual: int = 128):
    """Yield a function making transformers' ``QuantizedCache`` for ``model`` (``nbits`` codes in groups of ``group``).

    ``backend`` None picks the first importable of quanto / hqq. Raises :class:`BaselineUnavailable` when
    neither imports or the cache cannot be built.
    """
    backend = backend or quantized_backend()
    cls = _measured_quantized_cache_class()
    # transformers' defaults (axis 0 for keys and values: quanto groups ``group`` consecutive elements of
    # a token's head vector, one scale and zero point each); what users of QuantizedCache run.
    kwargs = dict(nbits=nbits, axis_key=0, axis_value=0, q_group_size=group,
                  residual_length=residual)
    try:
        cls(backend=backend, config=model.config, **kwargs)
    except Exception as exc:
        raise BaselineUnavailable(f"QuantizedCache(backend={backend!r}) failed: {type(exc).__name__}: {exc}"[:300]) from exc
    yield lambda: cls(backend=backend, config=model.config, **kwargs)


# ---------------------------------------------------------------- kvpress
class PrunedLayer(DynamicLayer):
    """A ``DynamicLayer`` that a press prunes at prefill and that reports the logical length (tokens seen)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        # transformers <= 5.2x passes cache_position (a tensor), later ones the query length (int).
        query_length = query if isinstance(query, int) else query.shape[0]
        held = 0 if self.keys is None or not self.is_initialized else self.keys.shape[-2]
        return held + query_length, 0


class PrunedCache(DynamicCache):
    """``DynamicCache`` of :class:`PrunedLayer`: decode positions stay those of the unpruned prompt.

    Example:
        >>> cache = PrunedCache(config=model.config)  # doctest: +SKIP
    """

    def __init__(self, config, **kwargs):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        super().__init__(config=config, **kwargs)
        self.layers = [PrunedLayer() for _ in range(cfg.num_hidden_layers)]

    def stats(self) -> dict:
        device = full = 0
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                device += _nbytes(layer.keys) + _nbytes(layer.values)
                b, h, _, d = layer.keys.shape
                full += 2 * b * h * layer.seen * d * layer.keys.element_size()
        return {"device_bytes": device, "host_bytes": 0, "full_bytes": full,
                "compression_ratio": full / device if device else float("nan")}


def make_press(name: str, compression_ratio: float):
    """A kvpress press by short name (``snapkv``, ``streamingllm``, ``expected_attention``) pruning ``compression_ratio``
    of the prompt's tokens (0.75 keeps a quarter). Raises :class:`BaselineUnavailable` with the import error."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}: expected one of {sorted(PRESSES)}")
    try:
        kvpress = importlib.import_module("kvpress")
        return getattr(kvpress, PRESSES[name])(compression_ratio=compression_ratio)
    except Exception as exc:
        raise BaselineUnavailable(f"kvpress {PRESSES[name]}: {type(exc).__name__}: {exc}"[:300]) from exc


def _press_hook(press):
    """kvpress's forward hook, given the keywords it reads under the names of the installed transformers.

    kvpress 0.5.5 (made for transformers < 5.3) reads ``past_key_values`` and ``cache_position``; newer
    transformers pass the cache as ``cache`` and may pass no ``cache_position``. The prefill test it makes
    (``cache_position[-1] + 1 == q_len``) is rebuilt from the tokens the layer has seen.
    """

    def hook(module, args, kwargs, output):
        cache = compat.cache_from_module_kwargs(kwargs)
        if cache is None:
            return output
        adapted = dict(kwargs)
        adapted["past_key_values"] = cache
        if adapted.get("cache_position") is None:
            q_len = adapted["hidden_states"].shape[1]
            seen = cache.layers[module.layer_idx].get_seq_length()
            adapted["cache_position"] = torch.arange(seen - q_len, seen, device=adapted["hidden_states"].device)
        return press.forward_hook(module, args, adapted, output)

    return hook


@contextmanager
def press_cache_factory(model, press: str, compression_ratio: float = 0.75):
    """Yield a function making :class:`PrunedCache`; ``press`` prunes each prefill inside the block.

    The hooks are kvpress's own (``press.forward_hook``), registered as ``press(model)`` does, through
    :func:`_press_hook` so that they also run on transformers newer than kvpress supports.
    """
    obj = make_press(press, compression_ratio)
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    hooks = []
    try:
        obj.post_init_from_model(model)
        for layer in inner.layers:
            layer.self_attn.rotary_emb = inner.rotary_emb  # kvpress presses read RoPE from the attention module
            hooks.append(layer.self_attn.register_forward_hook(_press_hook(obj), with_kwargs=True))
    except Exception as exc:
        for h in hooks:
            h.remove()
        raise BaselineUnavailable(f"kvpress {PRESSES[press]} could not hook the model: {type(exc).__name__}: {exc}"[:300]) from exc
    try:
        yield lambda: PrunedCache(config=model.config)
    finally:
        for h in hooks:
            h.remove()
        for layer in inner.layers:
            if "rotary_emb" in layer.self_attn._modules:
                del layer.self_attn._modules["rotary_emb"]
