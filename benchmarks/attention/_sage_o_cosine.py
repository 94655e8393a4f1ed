"""Sage's output against fp32 attention on a real model's own activations, layer by layer.

The fixture gate (:mod:`benchmarks.attention._attention_fidelity`) reads one stored layer of one text. This
measurement captures Q, K and V (after RoPE, as the attention function receives them) of a few layers of
the model being fine-tuned, on its held-out batches, in the dtype and on the device the study runs in, and
computes each call's O with Sage, once with V's FP8 rounding residual and once without (plain SageAttention2:
one FP8 product per tile), and with fp32 exact attention. The cosine is the fixture gate's: over one whole
call's output ``[B, H, N, D]`` flattened; per layer the min and median over the captured batches.

    >>> import torch
    >>> q = k = v = torch.randn(1, 2, 64, 64)
    >>> report = o_cosine([Capture(0, q, k, v, 64 ** -0.5, True)], backend="reference")
    >>> report["layers"]["0"]["v_residual"]["min"] > 0.99
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

import torch

from benchmarks.attention._attention_fidelity import FWD_COS

CAPTURE_NAME = "neutrain_capture"
SETTINGS = {"v_residual": True, "plain": False}  # report key: sage_attention's v_residual


@dataclass(frozen=True)
class Capture:
    """One attention call's inputs: ``[B, H, N, D]`` Q and ``[B, Hk, N, D]`` K, V of decoder layer ``layer``, and the
    output the model's exact attention gave for them (``[B, N, H, D]``; kept so a test can check the capture)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool
    out: torch.Tensor | None = None


def spread_layers(n_layers: int, count: int = 3) -> list[int]:
    """``count`` layer indices spread from the first to the last (outliers and sinks differ with depth).

    Example:
        >>> spread_layers(30), spread_layers(2), spread_layers(1, 3)
        ([0, 14, 29], [0, 1], [0])
    """
    if count <= 1 or n_layers == 1:
        return [0]
    return sorted({round(i * (n_layers - 1) / (count - 1)) for i in range(count)})


@torch.no_grad()
def capture_attention_inputs(model, batches: list[torch.Tensor], layers: list[int]) -> list[Capture]:
    """Run ``model`` on each batch of token ids with exact attention and keep the inputs of ``layers``' calls.

    The model's attention implementation is swapped for a recording wrapper around transformers' SDPA (so
    every layer sees exact attention's activations, as the reference the cosine compares with) and put back.
    """
    from neutrain import compat

    captured: list[Capture] = []
    wanted = set(layers)
    sdpa = compat.sdpa_attention()

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        out, weights = sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        layer = getattr(module, "layer_idx", None)
        if layer in wanted:
            causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
            captured.append(Capture(layer, query.detach().clone(), key.detach().clone(), value.detach().clone(),
                                    scale, causal, out.detach().clone()))
        return out, weights

    compat.register_attention_with_sdpa_mask(CAPTURE_NAME, record)
    before = model.config._attn_implementation
    was_training = model.training
    compat.set_attn_implementation(model, CAPTURE_NAME)
    model.eval()
    try:
        device = next(model.parameters()).device
        for ids in batches:
            model(input_ids=ids.to(device))
    finally:
        compat.set_attn_implementation(model, before)
        model.train(was_training)
    return captured


def o_cosine(captures: list[Capture], backend: str = "auto", config: dict | None = None) -> dict:
    """Per layer, the min and median cosine of Sage's O (each of :data:`SETTINGS`) against fp32 exact attention.

    ``backend`` is :func:`neutrain.attention.sage_attention`'s (``reference`` on the CPU; ``triton`` or
    ``gluon`` on a GPU), ``config`` its kernel settings (the dispatch table's, as the registration passes).
    ``min`` is the smallest over every layer and batch, per setting.
    """
    from neutrain.attention import accuracy_metrics, exact_attention, sage_attention

    cosines: dict[str, dict[str, list[float]]] = {}
    for c in captures:
        exact = exact_attention(c.q.float(), c.k.float(), c.v.float(), causal=c.causal, scale=c.scale)
        per_layer = cosines.setdefault(str(c.layer), {name: [] for name in SETTINGS})
        for name, v_residual in SETTINGS.items():
            with torch.no_grad():
                out = sage_attention(c.q, c.k, c.v, causal=c.causal, scale=c.scale, v_residual=v_residual,
                                     backend=backend, config=config)
            per_layer[name].append(accuracy_metrics(out, exact)["cos"])
    layers = {layer: {name: {"min": round(min(cs), 6), "median": round(median(cs), 6), "calls": len(cs)}
                      for name, cs in by_setting.items()}
              for layer, by_setting in cosines.items()}
    overall = {name: min((layers[layer][name]["min"] for layer in layers), default=None) for name in SETTINGS}
    return {"layers": layers, "min": overall, "backend": backend, "gate": FWD_COS,
            "shape": list(captures[0].q.shape) if captures else None,
            "dtype": str(captures[0].q.dtype).removeprefix("torch.") if captures else None}


def o_cosine_target(report: dict | None) -> dict:
    """The record's ``sage_o_cosine_min`` target: the smallest cosine over every layer, batch and setting."""
    goal = f">= {FWD_COS}"
    if not report or not report.get("layers"):
        return {"value": None, "goal": goal, "met": None, "not_measured": "run without --o-cosine-batches"}
    value = min(v for v in report["min"].values() if v is not None)
    return {"value": value, "goal": goal, "met": value >= FWD_COS, "by_setting": report["min"],
            "derived_from": "results.o_cosine: Sage's O against fp32 attention on the model's held-out activations"}
