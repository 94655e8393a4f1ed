"""The parser every command's arguments go through: a bad command line is one line naming the command and the
argument, exit 2, however it is bad.

Why one parser class: argparse answered a missing argument, an unknown option, an invalid choice, a flag without
its value or two exclusive flags with its usage text (up to nine lines for ``generate``) above its error, and
each command built its arguments on that parser. It also took a prefix of a long option for the option
(``--out`` for ``--output``, ``--temp`` for ``--temperature``): a command line that worked could stop working,
or mean another flag, the day a command gains an option with the same prefix; and an option given twice kept its
last value without a word (``--prompt a --prompt b`` answered ``b`` alone). Here every parser, the top one and
each command's (argparse makes the subparsers of the class of their parent), refuses each of those in one line:
an option is spelt whole (an unknown one names the nearest option the command has), and a flag that takes a
value is given once.

Example:
    >>> parser = CommandParser(prog="neutrain generate")
    >>> _ = parser.add_argument("--prompt")
    >>> parser.parse_known_args(["--prompt", "a"])[0].prompt
    'a'
    >>> unknown_arguments(parser, "generate", ["--promt", "b"])
    "generate: unknown option '--promt' (did you mean '--prompt'?); see `neutrain generate --help`"
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn

from neutrain.errors import print_error

EXIT_USAGE = 2


class _StoreOnce(argparse._StoreAction):  # noqa: SLF001 - argparse's own "store", refusing a second value
    """``store``, except that the option's second appearance on one command line is refused, naming both values."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(parser, "_given_once", None)
        if given is not None:
            if self.dest in given:
                first_flag, first = given[self.dest]
                parser.error(f"{option_string} given twice ({first_flag} {first!r}, then {option_string} {values!r}); "
                             "give it once")
            given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


class CommandParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose errors are one ``neutrain: error:`` line (exit 2, no usage text), that
    takes no abbreviation of a long option, and refuses a value-taking option given twice."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def add_argument(self, *args, **kwargs):
        # argparse counts a positional of nargs="*" without a default as required, so a missing recipe was
        # "the following arguments are required: recipe, overrides", as if an override were needed too.
        if args and not args[0].startswith(self.prefix_chars) and kwargs.get("nargs") == "*":
            kwargs.setdefault("default", [])
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given_once = {}  # the value-taking options seen on this command line (_StoreOnce)
        if args is not None and not any(isinstance(a, argparse._SubParsersAction) for a in self._actions):  # noqa: SLF001
            # A command's unknown option first: argparse reports a missing required option before what is left
            # over, so a misspelt `--promt` read "one of the arguments --prompt --input-file is required".
            unknown = _first_unknown_option(self, args)
            if unknown is not None:
                print_error(unknown_arguments(self, self._command() or None, [unknown]))
                sys.exit(EXIT_USAGE)
        return super().parse_known_args(args, namespace)

    def _command(self) -> str:
        return self.prog.split(" ", 1)[1] if " " in self.prog else ""

    def error(self, message: str) -> NoReturn:
        command = self._command()
        print_error(f"{command}: {message}" if command else message)
        sys.exit(EXIT_USAGE)


def _first_unknown_option(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """The first ``--name`` in ``args`` (before a ``--``) that is none of ``parser``'s options. An argument with a
    space is a value to argparse, whatever it starts with."""
    known = {s for action in parser._actions for s in action.option_strings}  # noqa: SLF001
    for arg in args:
        if arg == "--":
            return None
        if arg.startswith("--") and " " not in arg and arg.split("=", 1)[0] not in known:
            return arg.split("=", 1)[0]
    return None


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]  # noqa: SLF001


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` under the top ``parser``."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[command]


def unknown_arguments(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> str:
    """The line for arguments ``command`` (None: no command) does not take: its first unknown option with the
    nearest option it has (``--out``: ``--output``), or the arguments left over."""
    where, usage = (f"{command}: ", f"`neutrain {command} --help`") if command else ("", "`neutrain --help`")
    flag = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), None)
    if flag is None:
        return f"{where}unrecognized argument{'s' if len(extra) > 1 else ''} {' '.join(map(repr, extra))}; see {usage}"
    names = _options(parser)
    near = [n for n in names if n.startswith(flag)] or difflib.get_close_matches(flag, names, n=1, cutoff=0.6)
    hint = f" (did you mean {' or '.join(map(repr, near[:3]))}?)" if near else ""
    return f"{where}unknown option {flag!r}{hint}; see {usage}"
