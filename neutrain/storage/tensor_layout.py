"""Where each tensor of a model file lies: inside the data section, its bytes its own, its size its shape's.

Why: a model file's header says where each tensor's bytes are, and the readers (``gguf``'s memory map,
safetensors' Rust loader) believe it. A GGUF file whose ``blk.1.ffn_up`` offset equalled ``blk.1.ffn_gate``'s
loaded, generated, and exited 0: two weights read the same bytes and nothing said so. Both formats'
header walks (:mod:`neutrain.storage.gguf_header`, :func:`neutrain.storage.manifest.safetensors_header`) hand
their tensors' byte ranges to :func:`check_ranges`, which refuses the first range that leaves the data
section or shares a byte with another, in one line naming the file and both tensors.

Example:
    >>> check_ranges("GGUF file 'm.gguf'", [("a", 0, 64), ("b", 32, 96)], 128, ValueError)
    Traceback (most recent call last):
    ValueError: GGUF file 'm.gguf': tensors 'b' and 'a' share bytes (data bytes 32..96 and 0..64); each tensor must have bytes of its own
"""

from __future__ import annotations

from typing import Iterable


def check_ranges(label: str, ranges: Iterable[tuple[str, int, int]], data_size: int, error: type[Exception]) -> None:
    """Refuse a tensor whose ``[begin, end)`` byte range (relative to the data section) is empty-negative, ends
    past ``data_size``, or overlaps another tensor's.

    Args:
        label: Names the file, first in the message.
        ranges: ``(tensor name, begin, end)`` per tensor.
        data_size: Bytes in the data section.
        error: The error class raised (the callers': ``CheckpointError``).
    """
    ordered = sorted(ranges, key=lambda r: (r[1], r[2]))
    previous: tuple[str, int, int] | None = None
    for name, begin, end in ordered:
        if begin < 0 or end < begin:
            raise error(f"{label}: tensor '{name}' has the byte range {begin:,}..{end:,}, which is no range")
        if end > data_size:
            raise error(f"{label}: tensor '{name}' ends at data byte {end:,}, past the end of the data section "
                        f"({data_size:,} bytes): truncated or corrupt")
        if previous is not None and begin < previous[2] and end > begin:
            raise error(f"{label}: tensors '{name}' and '{previous[0]}' share bytes (data bytes {begin:,}..{end:,} and "
                        f"{previous[1]:,}..{previous[2]:,}); each tensor must have bytes of its own")
        if previous is None or end > previous[2]:
            previous = (name, begin, end)
