"""Numbers as a user writes them, read one way: ASCII digits only (:func:`parse_number`), for every numeric
recipe key, ``NEUTRAIN_*`` variable and command-line flag; and every numeric flag through one parser, a finite
number inside its range.

Why one parser: each command read its numbers with argparse's ``int``/``float``, which take what Python takes
(``'١٢'`` is 12, ``'1_000'`` is 1000, ``'inf'`` and ``'nan'`` are floats), and checked a range of its own later,
or none: ``--temperature 1e30`` sampled from a flat distribution, ``--max-shard-size 0.0001KB`` wrote a file per
tensor. A flag is declared with :func:`number_argument` and a :class:`NumberRule` (its kind and range); its text is
parsed and held to the range as argparse reads it, and a bad one is :class:`FlagError`, one line naming the flag,
exit 2. ``tests/faults/test_cli_numbers.py`` walks every command's parser: a numeric flag declared any other way
fails it.

Example:
    >>> parse_number("1e-5"), parse_number(" 12 ", integer=True), parse_number("-inf")
    (1e-05, 12, -inf)
    >>> parse_number("٣"), parse_number("1_0"), parse_number("1.5", integer=True)
    (None, None, None)
    >>> NumberRule(float, 0, 100).parse("--temperature", "0.7")
    0.7
    >>> NumberRule(int, 1, 64).parse("--draft-len", "١٢")
    Traceback (most recent call last):
    neutrain.config.numbers.FlagError: --draft-len: '١٢' is not an integer; expected ASCII digits, e.g. 8
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)
_SIZE = re.compile(r"\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*([KMGT])B\s*", re.IGNORECASE)
_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # decimal, as transformers' max_shard_size


def parse_number(text: str, integer: bool = False) -> float | int | None:
    """The number ``text`` spells with ASCII digits (surrounding whitespace allowed), or None when it spells none.

    ``integer``: only a whole number written without a point or an exponent. ``inf`` and ``nan`` parse (as floats),
    so that the caller's range check names them as not finite. Recipe values (``neutrain.config.fields``), the
    memory budget and the environment knobs read text through this too: ``memory.device_budget_gib=٣`` set a
    3 GiB budget, and ``NEUTRAIN_HOST_MEMORY_GIB=٣`` a 3 GiB host, before.
    """
    text = text.strip()
    if integer:
        return int(text) if _INTEGER.fullmatch(text) else None
    return float(text) if _DECIMAL.fullmatch(text) else None


class FlagError(Exception):
    """A command-line flag's value is not what the flag takes (one line, exit 2). Not a ``ValueError``: argparse
    would replace the line with its own "invalid value" and its usage text."""


@dataclass(frozen=True)
class NumberRule:
    """A numeric flag's kind (``int``, ``float`` or ``"size"``: a number and KB, MB, GB or TB), and its range.

    ``low_open``: the low end itself is out (``--top-p`` takes (0, 1]). ``why``: words after the range.
    """

    kind: type | str
    low: float
    high: float
    low_open: bool = False
    why: str = ""

    def rule(self) -> str:
        """The range in words: ``an integer from 1 to 64``."""
        if self.kind is int:
            return f"an integer from {self.low:,} to {self.high:,}"
        if self.kind == "size":
            return f"a size from {_shown_size(self.low)} to {_shown_size(self.high)} (a number and KB, MB, GB or TB)"
        low = f"> {_shown(self.low)}" if self.low_open else f"from {_shown(self.low)}"
        return f"a finite number {low} to {_shown(self.high)}"

    def parse(self, flag: str, text: str) -> int | float | str:
        """``text`` as this flag's value (a size stays the text it was, once checked)."""
        if self.kind is int:
            whole = parse_number(text, integer=True)
            if whole is None:
                raise FlagError(f"{flag}: {text!r} is not an integer; expected ASCII digits, e.g. 8")
            value: float = whole
        elif self.kind == "size":
            shape = _SIZE.fullmatch(text)
            if shape is None:
                raise FlagError(f"{flag}: {text!r} is not a size; expected a number and KB, MB, GB or TB, "
                                "e.g. 500MB or 5GB")
            value = float(shape.group(1)) * _UNITS[shape.group(3).upper()]
        else:
            number = parse_number(text)
            if number is None:
                raise FlagError(f"{flag}: {text!r} is not a number; expected ASCII digits, e.g. 0.7 or 1e-3")
            value = number
        self.check(flag, value, text)
        return text.strip() if self.kind == "size" else value

    def check(self, flag: str, value: float, shown: str | None = None, error: type[Exception] = FlagError) -> None:
        """Refuse ``value`` outside the range (also a value set in Python, not typed), as ``error``."""
        low_ok = value > self.low if self.low_open else value >= self.low
        if not (math.isfinite(value) and low_ok and value <= self.high):
            raise error(f"{flag}: {value if shown is None else shown} is out of range; expected "
                            f"{self.rule()}{self.why}")


SHARD_SIZE = NumberRule("size", 10**3, 10**15)
"""``--max-shard-size`` and ``export.max_shard_size``: from 1KB (a shard per tensor below it) to 1000TB."""


def _shown(value: float) -> str:
    """A range's end in words: ``1,048,576``, ``0.5``."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _shown_size(size: float) -> str:
    unit = next((u for u in "TGMK" if size >= _UNITS[u]), "K")
    return f"{size / _UNITS[unit]:g}{unit}B"


class _Typed:
    """The argparse ``type`` of one flag: its :class:`NumberRule`, parsing under the flag's own name."""

    def __init__(self, number: NumberRule, flag: str):
        self.number, self.flag = number, flag
        self.__name__ = {int: "integer", float: "number"}.get(number.kind, "size")  # argparse's words, if ever

    def __call__(self, text: str):
        return self.number.parse(self.flag, text)


def number_argument(parser, flag: str, number: NumberRule, **kwargs) -> None:
    """``parser.add_argument(flag, ...)`` for a numeric flag: its text parsed and held to ``number``."""
    parser.add_argument(flag, type=_Typed(number, flag), **kwargs)


def numeric_type(action) -> NumberRule | None:
    """The :class:`NumberRule` an argparse action parses with (None: not declared through :func:`number_argument`)."""
    return action.type.number if isinstance(action.type, _Typed) else None
