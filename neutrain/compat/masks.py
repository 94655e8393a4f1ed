"""transformers' packed-sequence probe, skipped where the positions are known to be contiguous.

Why: with no attention mask and no cache (a training forward), transformers'
``create_causal_mask`` derives ``position_ids`` and asks whether they hold several
packed sequences (``masking_utils.find_packed_sequence_indices``). The answer is
read on the host: ``if (mask[:, -1] == 0).all()`` copies a flag back from the GPU
and waits for every kernel queued before it, once per forward. When neutrain
calls the decoder itself without positions or a mask, the positions are
``arange(seq)`` in every row: one sequence per row, the case the probe returns
None for. :func:`contiguous_positions` says so, and the probe answers None without
reading anything. Any other call (positions passed, a mask, a cache, another
thread) goes to transformers' own function unchanged.

Example:
    >>> import torch
    >>> from transformers import masking_utils
    >>> packed = torch.tensor([[0, 1, 0, 1]])
    >>> install()
    True
    >>> masking_utils.find_packed_sequence_indices(packed).tolist()
    [[0, 0, 1, 1]]
    >>> with contiguous_positions():
    ...     masking_utils.find_packed_sequence_indices(torch.arange(4)[None]) is None
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

_CONTIGUOUS = contextvars.ContextVar("neutrain_contiguous_positions", default=False)
_MARK = "_neutrain_contiguous_probe"


def install() -> bool:
    """Wrap ``transformers.masking_utils.find_packed_sequence_indices`` once; False if this version has none."""
    module = importlib.import_module("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def probe(position_ids, *args, **kwargs):
        if _CONTIGUOUS.get():
            return None
        return original(position_ids, *args, **kwargs)

    setattr(probe, _MARK, True)
    probe.__wrapped__ = original
    module.find_packed_sequence_indices = probe
    return True


@contextlib.contextmanager
def contiguous_positions():
    """Inside: a forward that passed neither positions nor a mask skips the packed-sequence probe."""
    install()
    token = _CONTIGUOUS.set(True)
    try:
        yield
    finally:
        _CONTIGUOUS.reset(token)


def positions_are_contiguous() -> bool:
    """True inside :func:`contiguous_positions`: every row's positions are ``arange(seq)`` (nothing packed).

    Example:
        >>> with contiguous_positions():
        ...     positions_are_contiguous()
        True
        >>> positions_are_contiguous()
        False
    """
    return _CONTIGUOUS.get()
