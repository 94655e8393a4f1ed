"""Numbers as a user writes them in a recipe, an override, an environment variable or a flag: ASCII only.

Why: Python's ``int()`` and ``float()`` also read the digits of other scripts (``'٣'`` is 3, ``'１２８'`` is 128)
and underscores (``'1_0'`` is 10). A value pasted from a rendered page or typed with another keyboard layout then
set a budget or a learning rate that the user never saw written, with no word said. Every place that turns text
into a number goes through :func:`parse_number`, so each key, knob and flag reads the same numbers.

Example:
    >>> parse_number("1e-5"), parse_number(" 12 ", integer=True), parse_number("-inf")
    (1e-05, 12, -inf)
    >>> parse_number("٣"), parse_number("1_0"), parse_number("12", integer=True), parse_number("1.5", integer=True)
    (None, None, 12, None)
"""

from __future__ import annotations

import re

_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?[0-9]+")


def parse_number(text: str, integer: bool = False) -> float | int | None:
    """The number ``text`` spells with ASCII digits (surrounding whitespace allowed), or None when it spells
    none. ``integer``: only a whole number written without a point or an exponent. ``inf`` and ``nan`` parse (as
    floats), so that the caller's range check names them as not finite."""
    text = text.strip()
    if integer:
        return int(text) if _INTEGER.fullmatch(text) else None
    return float(text) if _FLOAT.fullmatch(text) else None
