"""The command line: one module per command, and :func:`main`, which dispatches to them.

``python -m neutrain <command>`` and the ``neutrain`` console script both land in
:func:`neutrain.cli.main.main`.

Example:
    >>> from neutrain.cli import main
    >>> main(["--version"])  # doctest: +SKIP
"""

from neutrain.cli.main import main

__all__ = ["main"]
