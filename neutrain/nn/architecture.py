"""What a transformers architecture does beyond plain ``nn.Linear``/``nn.Embedding``, kept under NeuZip.

Compressing a model swaps modules for compressed ones and trains through neutrain's
chunked loss instead of the model's own ``forward``; anything an architecture adds
there must survive the swap, or the model silently trains as another function:

* scaled embeddings (Gemma, Granite-style multipliers live in the decoder and need
  nothing): :func:`embedding_scale` reads ``embed_scale`` and *checks* on real rows
  that "lookup times scale" is what the original module computes, refusing otherwise;
* logits transforms in ``*ForCausalLM.forward`` (Gemma 2/3 final soft-capping,
  Cohere's ``logit_scale``, Granite's ``logits_scaling``): :func:`logit_transform`,
  applied by the chunked loss; so is the MoE router's load-balancing loss
  (:func:`router_aux_loss`, when ``output_router_logits`` is set);
* ``nn.Linear`` subclasses with their own ``forward``: refused (:func:`check_linear`);
* attention backends: :func:`auto_attention` picks one the architecture supports,
  :func:`check_attention` refuses an explicit one it does not.

Example:
    >>> from transformers import AutoConfig
    >>> auto_attention(AutoConfig.for_model("gemma2"), cuda=False)
    'eager'
    >>> logit_transform(AutoConfig.for_model("gemma2")).softcap
    30.0
"""

from __future__ import annotations

import dataclasses

import torch

from neutrain.errors import RecipeError


class UnsupportedArchitectureError(RecipeError):
    """An architecture neutrain cannot train compressed; the message names the module and what is missing."""


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """``logits -> softcap(logits * scale / divisor)``, what a model's forward applies after the lm_head.

    ``softcap(x) = cap * tanh(x / cap)``. :meth:`apply` computes it on fp32 logits and
    :meth:`backward` maps a gradient w.r.t. transformed logits to the raw ones.

    Example:
        >>> t = LogitTransform(scale=0.5)
        >>> t.apply(torch.tensor([4.0])).item(), t.backward(torch.tensor([4.0]), torch.tensor([1.0])).item()
        (2.0, 0.5)
    """

    scale: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale is None and self.divisor is None and self.softcap is None

    def _linear(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        return logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = self._linear(logits)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def backward(self, raw_logits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the raw logits, given ``grad`` w.r.t. the transformed ones."""
        if self.softcap is not None:
            t = torch.tanh(self._linear(raw_logits) / self.softcap)
            grad = grad * (1 - t * t)
        if self.scale is not None:
            grad = grad * self.scale
        if self.divisor is not None:
            grad = grad / self.divisor
        return grad


def logit_transform(config) -> LogitTransform:
    """The logits transform the architecture's ``*ForCausalLM.forward`` applies (identity for most)."""
    model_type = getattr(config, "model_type", "")
    scale = getattr(config, "logit_scale", None) if model_type.startswith("cohere") else None
    divisor = getattr(config, "logits_scaling", None) if model_type.startswith("granite") else None
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(
        scale=float(scale) if scale not in (None, 1, 1.0) else None,
        divisor=float(divisor) if divisor not in (None, 1, 1.0) else None,
        softcap=float(softcap) if softcap else None,
    )


def router_aux_loss(model):
    """The MoE load-balancing loss the model's forward adds when ``config.output_router_logits`` is set, or None.

    Returns ``aux(router_logits, attention_mask) -> coef * load_balancing_loss``, using the
    function and attributes of the model's own module (Mixtral, Qwen2/3-MoE, OLMoE, ... share
    the pattern).

    Raises:
        UnsupportedArchitectureError: the flag is set but the model does not follow that pattern.
    """
    import sys

    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return None
    loss_fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    attrs = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if loss_fn is None or not all(hasattr(model, a) for a in attrs):
        raise UnsupportedArchitectureError(
            f"model.config.output_router_logits: neutrain's chunked loss does not know {type(model).__name__}'s "
            "router loss (set it false)")

    def aux(router_logits, attention_mask):
        balance = loss_fn(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
        return model.router_aux_loss_coef * balance

    return aux


def causal_lm_class(config):
    """The ``AutoModelForCausalLM`` class of ``config`` (None for an unknown config class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def auto_attention(config, cuda: bool) -> str:
    """``attn_implementation: auto``: the fastest backend the architecture supports.

    On a GPU, ``neutrain_sage`` where the model takes registered attention functions
    (it falls back to SDPA or a math path per call, soft-capping included); otherwise
    ``sdpa`` where transformers allows it (Gemma 2 does not: SDPA cannot soft-cap), else ``eager``.
    """
    cls = causal_lm_class(config)
    if cls is None:  # remote code: nothing to read the support from
        return "neutrain_sage" if cuda else "sdpa"
    if cuda and getattr(cls, "_supports_attention_backend", False):
        return "neutrain_sage"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


_ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "neutrain_sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}


def check_attention(config, attn: str) -> None:
    """Refuse an attention backend the architecture's transformers class does not support (one clear line).

    Example:
        >>> from transformers import AutoConfig
        >>> check_attention(AutoConfig.for_model("gemma2"), "sdpa")
        Traceback (most recent call last):
        ...
        neutrain.nn.architecture.UnsupportedArchitectureError: model.attn_implementation: Gemma2ForCausalLM has no sdpa attention in transformers (use auto or eager)
    """
    cls = causal_lm_class(config)
    flag = _ATTENTION_FLAGS.get(attn)
    if cls is not None and flag is not None and not getattr(cls, flag, False):
        raise UnsupportedArchitectureError(
            f"model.attn_implementation: {cls.__name__} has no {attn} attention in transformers (use auto or eager)")


def check_linear(name: str, module: torch.nn.Module) -> None:
    """Refuse an ``nn.Linear`` subclass whose ``forward`` is not ``nn.Linear``'s (compressing it would drop it)."""
    if type(module).forward is not torch.nn.Linear.forward:
        raise UnsupportedArchitectureError(
            f"{name}: {type(module).__name__} overrides nn.Linear.forward; NeuZip would drop its behaviour "
            "(use memory.weights: dense)")


def embedding_scale(name: str, module: torch.nn.Embedding, weight: torch.Tensor):
    """The scale a (sub)class of ``nn.Embedding`` multiplies its rows by, checked on real rows.

    Args:
        name: the module's name (for the error).
        module: the original embedding (its own weight may be on the meta device).
        weight: the table's values (any dtype; a few rows are used).

    Returns:
        None for a plain lookup, else the module's ``embed_scale`` (tensor or float).

    Raises:
        UnsupportedArchitectureError: the module's forward is neither a lookup nor a scaled lookup.
    """
    if type(module).forward is torch.nn.Embedding.forward:
        return None
    scale = getattr(module, "embed_scale", None)
    if scale is not None and not isinstance(scale, (torch.Tensor, float, int)):
        scale = None
    meta = module._parameters["weight"]
    rows = weight[: min(64, weight.shape[0])].detach().to(meta.dtype)
    ids = torch.arange(rows.shape[0], device=rows.device)
    buffers = dict(module._buffers)
    if isinstance(scale, torch.Tensor) and scale.is_meta:
        # Not materialised yet (transformers' loading builds on the meta device and fills
        # non-persistent buffers in _init_weights, from this attribute).
        scalar = getattr(module, "scalar_embed_scale", None)
        if scalar is None:
            raise UnsupportedArchitectureError(f"{name}: {type(module).__name__}.embed_scale is not materialised")
        scale = buffers["embed_scale"] = torch.tensor(scalar)
    probe = object.__new__(type(module))  # the original forward on real rows, without touching the module
    probe.__dict__.update(module.__dict__)
    probe._parameters = {**module._parameters, "weight": torch.nn.Parameter(rows, requires_grad=False)}
    probe._buffers = {k: (v.to(rows.device) if v is not None else v) for k, v in buffers.items()}
    probe.padding_idx = None
    with torch.no_grad():
        got = probe(ids)
        expected = torch.nn.functional.embedding(ids, rows)
        if isinstance(scale, torch.Tensor):
            expected = expected * scale.to(device=rows.device, dtype=rows.dtype)
        elif scale is not None:
            expected = expected * scale
    if got.shape != expected.shape or not torch.equal(got, expected):
        raise UnsupportedArchitectureError(
            f"{name}: {type(module).__name__}.forward is neither an embedding lookup nor a lookup times "
            "embed_scale; NeuZip cannot reproduce it (use memory.weights: dense)")
    return scale
