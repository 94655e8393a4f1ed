"""Decoder layers compiled for the one-token decode step, used by :class:`~neutrain.decode.engine.DecodeEngine`.

At batch 1 the GEMVs of a Llama-3-8B step read 15 GB in ~3.6 ms at the HBM's rate, yet the graph-replayed step
takes ~6.9 ms. Beside each layer's four GEMVs, Hugging Face's eager layer runs a few dozen small kernels:
RMSNorm's cast, square, mean, rsqrt and products; RoPE's halves, negation, concatenation and products; SiLU
and the gate product; the residual adds; the cache write. Inside a CUDA graph each still costs its launch-to-
completion latency (a few microseconds for a few kilobytes of work), so their sum, not the bytes, sets the
step. ``torch.compile`` (Inductor, one fixed shape) fuses each run of pointwise ops into one kernel; the
projections stay the same cuBLAS (or fused-group) products, and the engine's CUDA graph captures the result.

Only calls of ``max_rows`` query tokens or fewer go through the compiled layers (the decode step, one token):
a prefill's length varies from prompt to prompt, and compiling each would cost more than it saves.

Exactness: Inductor may sum a reduction (RMSNorm's mean) in another order and keep an intermediate in fp32
where the eager op rounds it to bf16, so logits can differ from the eager layers' in the last bits, and a
greedy decode may take the other branch of a near tie. That is why the engine compiles only when asked
(``DecodeEngine(compile_layers=True)``), and ``benchmarks/decode/engine_decode.py`` records whether the compiled row's
greedy tokens equal the eager row's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch._dynamo
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` in transformers' causal LMs), or a ValueError saying why not."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile_layers needs a causal LM with decoder layers at model.model.layers; "
                         f"{type(model).__name__} has none")
    return layers


class CompiledLayers:
    """The compiled forwards of ``model``'s decoder layers, switched on per call by :meth:`active`.

    The model is left as it was outside :meth:`active`: each layer's ``forward`` is shadowed by its compiled
    version only while the context lasts, so training, saving and a prefill see the eager layers.
    """

    def __init__(self, model: nn.Module, max_rows: int = 1):
        self.model, self.max_rows = model, int(max_rows)
        self.layers = list(decoder_layers(model))
        # One compiled entry serves every layer: nn.Module parameters are graph inputs (inlined modules), so the
        # 32 layers of an 8B share one graph per shape. The limit is raised so a model's layers never exhaust it.
        limit = max(len(self.layers) + 8, torch._dynamo.config.cache_size_limit)
        torch._dynamo.config.cache_size_limit = limit
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
        self.compiled = [torch.compile(layer.forward, dynamic=False) for layer in self.layers]

    def usable(self, rows: int) -> bool:
        """Whether a call of ``rows`` query tokens may use the compiled layers: few enough rows, and every fused
        projection group still sitting on its fused matrix (the compiled layers skip that host check, which reads
        data pointers, so it is made here, once per call)."""
        if rows > self.max_rows:
            return False
        groups = getattr(self.model, "_neutrain_fused_groups", None) or []
        return all(group.intact() for group in groups)

    @contextlib.contextmanager
    def active(self, rows: int) -> Iterator[bool]:
        """Within this context a call of ``rows`` query tokens runs the compiled layers if :meth:`usable`;
        yields whether it does."""
        if not self.usable(rows):
            yield False
            return
        for layer, compiled in zip(self.layers, self.compiled):
            layer.forward = compiled  # an instance attribute: shadows the class's forward, nothing else changes
        try:
            yield True
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
