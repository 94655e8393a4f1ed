"""Token-by-token decoding fast enough to serve: the decode engine and the products it runs.

:class:`~neutrain.decode.engine.DecodeEngine` holds a static KV cache, samples on the device and replays one
CUDA graph per token. What makes each step cheap lives beside it: fused Q/K/V and gate/up projections
(:mod:`~neutrain.decode.fused_projections`), the split-K GEMV dispatch (:mod:`~neutrain.decode.gemv`), the
12-bit zgemv layout of NeuZip weights (:mod:`~neutrain.decode.zgemv`, :mod:`~neutrain.decode.zgemv_release`),
decoder layers compiled for the one-token step (:mod:`~neutrain.decode.compiled_layers`) and top-k/top-p
truncation (:mod:`~neutrain.decode.truncation`). Speculative decoding (``neutrain.speculative``), evaluation
(``neutrain.eval``) and ``neutrain generate`` build on it, so it sits below all three.
"""

from neutrain.decode.engine import DecodeEngine, sample_tokens

__all__ = ["DecodeEngine", "sample_tokens"]
