"""Run a recipe file as a Python script: the ``neutrain-recipe`` source encoding.

``accelerate launch recipes/default.yaml`` and ``torchrun recipes/default.yaml`` hand the file
to ``python``, which cannot parse YAML. Every shipped recipe therefore carries, on its second
line (after the shebang), a PEP 263 encoding declaration that YAML reads as a comment::

    #!/usr/bin/env neutrain
    # coding: neutrain-recipe (python runs this file as neutrain's CLI: `accelerate launch <recipe>` works)

When python opens such a file it looks the codec up; the one-line ``neutrain-recipe.pth`` that
every wheel of the package carries (build_backend/neutrain_backend.py adds it, for ``pip install .``
and ``pip install -e .`` alike) registers a search function that imports this module only for that
name, so interpreter start-up imports nothing more. The same line wraps ``sys.excepthook`` for the
launchers that run recipes (:data:`PTH_LINE`), importing nothing either until a launch fails.
The codec "decodes" the whole file to one statement calling neutrain's CLI on the file itself
with the script's arguments, so ``python recipes/x.yaml key=value`` is
``python -m neutrain train recipes/x.yaml key=value``. Nothing else reads recipes through this
codec: neutrain's loader decodes the bytes as UTF-8 (see ``recipe_yaml``), and so does any YAML
tool. ``python -m neutrain`` stays the canonical form; this only makes the literal launch line work.

Why the decoded text starts with a newline: CPython's file tokenizer switches to the codec after
reading the declaration line, re-positions one byte before the end of that line and throws away
the first line it reads back through the codec. Pure-Python readers (``runpy``, ``linecache``)
decode the whole file; the blank first line is harmless there.

This module itself imports only ``codecs``: it is imported inside a codec lookup. (Its package,
``neutrain.config``, brings PyYAML and the schema, which the CLI loads next anyway.)

Example:
    >>> info = search("neutrain_recipe")
    >>> "neutrain.cli" in info.decode(b"train:\\n  max_steps: 2\\n")[0]
    True
    >>> search("utf_8") is None
    True
"""

from __future__ import annotations

import codecs

#: The encoding name recipes declare (``# coding: neutrain-recipe``); lookups see it normalised.
NAME = "neutrain-recipe"
NORMALISED = "neutrain_recipe"

#: What python compiles instead of the YAML: train on this very file with the script's arguments.
SCRIPT = (
    "\nimport sys; from neutrain.cli import main as _neutrain_main; "
    "sys.exit(_neutrain_main(['train', __file__, *sys.argv[1:]]))\n"
)

#: The line of ``neutrain-recipe.pth``: registers a lookup that imports this module only for NAME, and wraps
#: ``sys.excepthook`` so that a launcher's ``ChildFailedError`` (torchrun, ``accelerate launch``) goes to
#: :func:`neutrain.compat.elastic.excepthook`, imported only then: a launch that ended in neutrain's one-line
#: refusals ends without the launcher's traceback. Every other exception reaches the hook that was there.
PTH_LINE = (
    "import codecs, sys; codecs.register(lambda name: __import__('neutrain.config.recipe_codec', "
    f"fromlist=['search']).search(name) if name == {NORMALISED!r} else None); "
    "sys.excepthook = (lambda previous: lambda kind, value, tb: __import__('neutrain.compat.elastic', "
    "fromlist=['excepthook']).excepthook(previous, kind, value, tb) if kind.__name__ == 'ChildFailedError' "
    "else previous(kind, value, tb))(sys.excepthook)\n"
)


def _decode(data: bytes, errors: str = "strict") -> tuple[str, int]:
    return SCRIPT, len(data)


class _IncrementalDecoder(codecs.IncrementalDecoder):
    """Emits SCRIPT once, on the first call, and swallows the rest of the file."""

    def __init__(self, errors: str = "strict") -> None:
        super().__init__(errors)
        self._sent = False

    def decode(self, input: bytes, final: bool = False) -> str:  # noqa: A002 (codecs' signature)
        if self._sent:
            return ""
        self._sent = True
        return SCRIPT

    def reset(self) -> None:
        self._sent = False

    def getstate(self) -> tuple[bytes, int]:
        return b"", int(self._sent)

    def setstate(self, state: tuple[bytes, int]) -> None:
        self._sent = bool(state[1])


class _StreamReader(codecs.StreamReader):
    def decode(self, input: bytes, errors: str = "strict") -> tuple[str, int]:  # noqa: A002
        return _decode(input, errors)


def search(name: str) -> codecs.CodecInfo | None:
    """Codec search function: the ``neutrain-recipe`` codec for its (normalised) name, else None.

    Encoding is plain UTF-8 (nothing writes recipes through this codec; it exists so the codec
    is complete). Decoding ignores the bytes and returns :data:`SCRIPT`.

    Example:
        >>> search("neutrain_recipe").name
        'neutrain-recipe'
    """
    if name not in (NAME, NORMALISED):
        return None
    return codecs.CodecInfo(
        name=NAME, encode=codecs.utf_8_encode, decode=_decode,
        incrementalencoder=codecs.getincrementalencoder("utf-8"), incrementaldecoder=_IncrementalDecoder,
        streamreader=_StreamReader, streamwriter=codecs.getwriter("utf-8"),
    )
