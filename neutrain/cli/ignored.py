"""Options a command would ignore for the target it was given: refused in one line, never dropped silently.

Why: an option that does nothing for this target still reads as a request. ``neutrain eval RECIPE --recipe
OTHER`` evaluated on RECIPE's data; ``neutrain export DENSE_CKPT --base X`` exported the checkpoint unmerged;
``generate --num-drafts 4`` without ``--draft``, or ``--top-k 5`` under greedy decoding, printed what plain
greedy decoding prints. Each ended with exit 0 and a result the user had not asked for. The parser records
which options the user typed (``args.given``, by destination), so an option given at its default value counts
as given, and one left out is never refused.

Example:
    >>> import argparse
    >>> refuse_ignored(argparse.Namespace(given={"top_k"}), ["top_k", "top_p"], "decoding is greedy",
    ...                "give --temperature > 0 to sample")
    Traceback (most recent call last):
    neutrain.errors.UserInputError: --top-k: the command would ignore it (decoding is greedy); give --temperature > 0 to sample, or drop --top-k
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from neutrain.errors import UserInputError


def refuse_ignored(args: argparse.Namespace, options: Iterable[str], because: str, instead: str) -> None:
    """Refuse the first of ``options`` (destinations) the user gave, which the command would ignore ``because``."""
    given = getattr(args, "given", ())
    for dest in options:
        if dest in given:
            flag = "--" + dest.replace("_", "-")
            raise UserInputError(f"{flag}: the command would ignore it ({because}); {instead}, or drop {flag}")


def given_options(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> set[str]:
    """The destinations of the options of ``command`` that ``argv`` gives (not those left at their default):
    ``argv`` parsed again with every default of that command suppressed, so only what was typed is set."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    actions = [a for a in commands.choices[command]._actions if a.option_strings]  # noqa: SLF001
    defaults = [a.default for a in actions]
    for action in actions:
        action.default = argparse.SUPPRESS
    try:
        given, _ = parser.parse_known_args(argv)
    finally:
        for action, default in zip(actions, defaults):
            action.default = default
    return {a.dest for a in actions} & set(vars(given))
