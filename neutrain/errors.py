"""Errors for bad user input: recipes, data files, checkpoints and command lines.

Why a dedicated type: the CLI turns every :class:`UserInputError` into one
clear line on stderr and exit code 2, never a traceback. Library code raises it
whenever the fault lies with what the user gave, naming the key, file or value
and what was expected.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input from the user. The message names the culprit and what was expected."""


class RecipeError(UserInputError):
    """A recipe key is unknown, has the wrong type, is out of range, or names a missing path."""


class DataError(UserInputError):
    """A data file is missing, unreadable, or has a malformed row (message names file and row)."""


class CheckpointError(UserInputError):
    """A checkpoint is missing, incomplete or corrupted."""


class StoppedBySignal(Exception):
    """Training stopped at a step boundary after SIGTERM/SIGINT (:mod:`neutrain.trainer.signals`).

    Not bad input: the CLI prints the message (which names the saved checkpoint) as one line and
    exits with ``exit_code``, 128 + the signal number, as a process killed by that signal would.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


def one_line(exc: BaseException) -> str:
    r"""``str(exc)`` on one line: library messages often span several, and the CLI prints one.

    Example:
        >>> one_line(ValueError("bad value:\n    hidden_size"))
        'bad value: hidden_size'
    """
    return " ".join(str(exc).split()) or type(exc).__name__


def print_error(message: str, prefix: str = "neutrain: error: ") -> None:
    """Write ``prefix + message`` and its newline to stderr in one write, then flush.

    Why one write: ``print`` writes the text and the newline separately, and when two
    processes of one torchrun share a stderr pipe, their lines interleave between the
    two writes ("...checkpoint-4neutrain: error: ...\\n\\n"). A pipe write under 4 KiB
    is atomic, so one write keeps each process's line whole.

    Example:
        >>> import contextlib, io
        >>> buf = io.StringIO()
        >>> with contextlib.redirect_stderr(buf):
        ...     print_error("recipe.yaml: unknown key 'lr'")
        >>> buf.getvalue()
        "neutrain: error: recipe.yaml: unknown key 'lr'\\n"
    """
    import sys  # here: this module is imported by everything and needs nothing else

    sys.stderr.write(f"{prefix}{message}\n")
    sys.stderr.flush()
