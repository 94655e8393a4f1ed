"""Quantized attention: training-aware SageAttention2 and its transformers registration.

``sage_attention(q, k, v, causal=False, scale=None)`` is INT8-QK / FP8-PV attention
with a straight-through backward; ``register()`` makes it available to transformers
as ``attn_implementation="neutrain_sage"`` (CPU runs use the pure-PyTorch quantized
reference). Kernels are imported lazily, on first use.
"""

from neutrain.attention.counters import counters, reset_counters
from neutrain.attention.reference import accuracy_metrics, exact_attention
from neutrain.attention.registration import ATTENTION_NAME, register
from neutrain.attention.sage import sage_attention

__all__ = [
    "ATTENTION_NAME",
    "accuracy_metrics",
    "counters",
    "exact_attention",
    "register",
    "reset_counters",
    "sage_attention",
]
