"""NeuZip weight compression: lossless (and lossy) entropy coding of float tensors.

A weight splits into an entropy-coded exponent stream (lane-interleaved,
12-bit-limited canonical Huffman) and raw sign/mantissa bits; see
``docs/codec.md`` §8 for the design and
:mod:`neutrain.compress.codec` for the layout.

Example:
    >>> import torch
    >>> from neutrain.compress import compress, CompressedTensor
    >>> w = torch.randn(128, 64).bfloat16() * 0.02
    >>> ct = compress(w)
    >>> torch.equal(ct.decompress(), w)
    True
    >>> again = CompressedTensor.from_state_dict(ct.state_dict(), name="w")
    >>> torch.equal(again.decompress(), w)
    True
"""

from neutrain.compress.format import CorruptTensorError
from neutrain.compress.many import decode_many, encode_many
from neutrain.compress.stream import StreamOverflowError
from neutrain.compress.tensor import CompressedTensor, compress

__all__ = ["CompressedTensor", "CorruptTensorError", "StreamOverflowError", "compress", "decode_many", "encode_many"]
