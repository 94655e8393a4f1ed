"""The ``neutrain`` command line.

    neutrain recipes/default.yaml [section.key=value ...]      # same as `neutrain train ...`
    neutrain train  <recipe> [overrides]                        # train, evaluate, export
    neutrain eval   <recipe | checkpoint> [overrides]           # held-out perplexity (+ long-context tasks)
    neutrain export <checkpoint> --format hf|neuzip|neuzip-lossy-<k> [--output DIR]  # inference export
    neutrain estimate <recipe> [overrides]                      # predict peak GPU memory, loading nothing
    neutrain distill  <recipe> [overrides]                      # distil a draft from the trained target
    neutrain generate <model> --prompt TEXT [--draft DIR]       # (speculative) sampling; --input-file FILE for many
    neutrain chat     <model>                                   # a conversation on stdin, the model loaded once
    neutrain recipes                                            # list shipped recipes

Bad input (recipe, data, checkpoint, arguments) prints one line naming the key,
file or value and exits with code 2; a failure of the environment (full disk,
read-only file system, unusable output_dir) prints one line naming the path and
exits with code 1; so does a device allocation over ``memory.device_budget_gib``, naming the phase of the run
it happened in (:func:`neutrain.memory.phases.out_of_memory_line`). NEUTRAIN_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from neutrain.cli.arguments import CommandParser, command_parser, unknown_arguments
from neutrain.cli.environment import EXIT_ENVIRONMENT, check_launch_environment, describe_environment_error
from neutrain.cli.ignored import given_options
from neutrain.config.numbers import FlagError
from neutrain.cli.stdout import StdoutError, flush_stdout, guard_stderr, guard_stdout, open_standard_streams
from neutrain.compat.deepspeed_env import name_cpu_accelerator
from neutrain.compat.elastic import error_file, record_refusal
from neutrain.compat.quiet import quiet_progress_bars
from neutrain.starting import end_of_start
from neutrain.config.knobs import check_environment, knob
from neutrain.errors import StoppedBySignal, UserInputError, one_line, print_error

EXIT_USER_ERROR = 2

@dataclass(frozen=True)
class Command:
    """Where a command lives and its line in ``neutrain --help``.

    ``module`` provides ``configure(parser)`` (the command's arguments, on the subparser made here) and
    ``run(args) -> exit code``.
    """

    module: str
    help: str


COMMANDS = {
    "train": Command("neutrain.cli.train", "train with a recipe (default when the first argument is a YAML file)"),
    "eval": Command("neutrain.cli.eval", "evaluate a recipe's model or a checkpoint"),
    "export": Command("neutrain.cli.export", "export a checkpoint for inference"),
    "estimate": Command("neutrain.cli.estimate", "predict peak GPU memory of a recipe before loading anything"),
    "distill": Command("neutrain.cli.distill", "distil a small draft from a trained target (recipe's distill section)"),
    "generate": Command("neutrain.cli.generate", "generate text, speculatively when a draft is given"),
    "chat": Command("neutrain.cli.chat", "chat with a model on the terminal, the model loaded once"),
    "recipes": Command("neutrain.cli.recipes", "list the shipped recipes"),
}
"""Every command by name. Why modules by path and the help lines here: a command's module is imported only
when that command runs (or its own ``--help`` is asked for). Importing all of them put every command's
imports in front of ``neutrain --help`` and of every argument error."""


def command_module(name: str):
    """The module of command ``name`` (imported now, on first use)."""
    return importlib.import_module(COMMANDS[name].module)


def _command_named(argv: list[str]) -> str | None:
    """The command ``argv`` runs: its first argument that is not an option, when it names one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of ``command`` only: the other commands are listed by name and line."""
    p = CommandParser(
        prog="neutrain",
        description="neutrain: full fine-tuning of LLMs in far less memory (NeuZip-compressed weights, fused updates).",
        epilog="Run `neutrain train --help` for every recipe key. Launch on GPUs with "
        "`accelerate launch -m neutrain recipes/<name>.yaml` (configs in launch/).\n\n"
        "Errors are one line on stderr: exit 2 for bad input (recipe, data, checkpoint, arguments), exit 1 for the "
        "environment (full disk, read-only file system, unusable output_dir). Set NEUTRAIN_DEBUG=1 to see the traceback.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The package's own __version__, read from the parent package already loaded (importing it would be an
    # import upward in the layer order; a parent package is in sys.modules whenever its submodule runs).
    p.add_argument("--version", action="version", version=f"neutrain {sys.modules['neutrain'].__version__}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, entry in COMMANDS.items():
        line = entry.help
        sub_parser = sub.add_parser(name, help=line, description=line[:1].upper() + line[1:] + ".")
        if name == command:
            command_module(name).configure(sub_parser)
    return p


def _argv_with_default_command(argv: list[str]) -> list[str]:
    # Any path that exists, whatever its kind: `neutrain <a FIFO>` is then refused as the recipe it was
    # meant to be (naming its kind), not as an unknown command.
    if argv and argv[0] not in {*COMMANDS, "-h", "--help", "--version"} and (argv[0].endswith((".yaml", ".yml")) or os.path.lexists(argv[0])):
        return ["train", *argv]
    return argv


def _unknown_command(argv: list[str]) -> str | None:
    """The one-line refusal of a first argument that is neither a command nor a recipe file, naming the nearest
    command or shipped recipe; None for any other first argument (argparse's own checks then apply).

    Why: argparse answered a first argument ``defualt`` with its usage and the list of commands, and nothing about the
    recipe that was meant.
    """
    first = argv[0] if argv else None
    if first is None or first.startswith("-") or first in COMMANDS:
        return None
    command = difflib.get_close_matches(first, list(COMMANDS), n=1, cutoff=0.6)
    if command:
        hint = f"did you mean `neutrain {command[0]}`?"
    else:
        from neutrain.config.validate import nearest_recipe  # lazy: read only on this error

        recipe = nearest_recipe(Path(first))
        hint = f"did you mean `neutrain train {recipe}`?" if recipe else "see `neutrain --help`"
    return f"'{first}' is neither a command ({', '.join(COMMANDS)}) nor a recipe file: {hint}"


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that dotted overrides may follow an option.

    Why: ``neutrain eval CKPT --recipe R eval.max_eval_samples=2`` was "unrecognized arguments", while
    ``eval CKPT eval.max_eval_samples=2 --recipe R`` worked: argparse fills a ``nargs="*"`` positional only
    from the arguments before the first option. Every command that takes overrides takes them anywhere.
    """
    args, extra = parser.parse_known_args(argv)
    # A `--` ends the options (POSIX): argparse leaves it among the unknown arguments once a command has taken an
    # option (`eval CKPT --recipe R -- eval.max_eval_samples=2`), where it is no argument of its own.
    extra = [a for a in extra if a != "--"]
    overrides = [a for a in extra if not a.startswith("-") and "=" in a]
    if extra and (len(overrides) != len(extra) or not hasattr(args, "overrides")):
        rest = [a for a in extra if a not in overrides] if hasattr(args, "overrides") else extra
        own = parser if args.command is None else command_parser(parser, args.command)
        parser.error(unknown_arguments(own, args.command, rest))
    if overrides:
        args.overrides = [*(args.overrides or []), *overrides]
    return args


def _debug() -> bool:
    """``NEUTRAIN_DEBUG`` (False when it is not a boolean: its own one-line error says so)."""
    try:
        return knob("NEUTRAIN_DEBUG")
    except UserInputError:
        return False


def _refuse(line: str, main_rank_only: bool) -> None:
    """Print a refusal's one line, once per launch, and record it where torch elastic's launcher looks.

    Outside torch elastic each process says its own refusal, except one that every process reaches
    (``main_rank_only``): the first says that one. Under torch elastic only the first process says a
    refusal, every process writes its line to the error file the launcher gave it, and the launcher prints
    the lines no process said, without its traceback (:mod:`neutrain.compat.elastic`).
    """
    first = os.environ.get("RANK", "0") == "0"
    said = first or not (main_rank_only or error_file() is not None)
    if said:
        print_error(line)
    record_refusal(f"neutrain: error: {line}", said)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neutrain`` console script and ``python -m neutrain``."""
    open_standard_streams()  # before any file is opened: none may take a closed 0, 1 or 2 (cli.stdout)
    guard_stderr()  # a stderr that cannot be written changes no exit status
    guard_stdout()  # before anything is printed: its failures are stdout's, never the run's (cli.stdout)
    try:
        end_of_start()  # Ctrl-C is a KeyboardInterrupt from here on, answered below (neutrain.starting before)
        try:
            return _main(argv)
        finally:  # also after argparse's --help and its errors (SystemExit): a full stdout is said here, once
            flush_stdout()
    except StdoutError as exc:
        print_error(str(exc))
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:  # before the command ran: parsing, importing the command's module
        print_error("interrupted", prefix="neutrain: ")
        return 130


# The namespace attributes that hold a path, by every command that has them; ``recipe`` is an option of eval.
_PATH_ARGUMENTS = ("recipe", "target", "checkpoint", "model", "output", "base", "draft", "input_file")


def check_path_arguments(args: argparse.Namespace) -> None:
    """Hold every path argument of every command to what a path-valued recipe key is held to
    (:func:`neutrain.config.values.check_text`), naming the argument: UTF-8 text, no NUL or control character,
    not empty and no surrounding whitespace, a length its file system can hold.

    Why the recipe keys' rule: each argument had a subset of it. A name past ``NAME_MAX`` failed as a bare "File
    name too long", a byte that is not UTF-8 in a ``UnicodeEncodeError`` traceback where a library wrote it; an
    empty argument was taken as no argument or as the working folder (``generate M --draft ''`` generated without
    the draft, exit 0; ``--input-file ''`` was a ``TypeError`` traceback; ``chat ''`` looked for a model in ``.``);
    ``export --output 'out '`` created a folder whose name ends in a space, which ``export.output_dir: 'out '``
    refuses.
    """
    from neutrain.config.values import check_text  # lazy: `neutrain --help` imports no recipe code

    for attr in _PATH_ARGUMENTS:
        value = getattr(args, attr, None)
        if not isinstance(value, str):
            continue
        optional = attr not in ("target", "checkpoint", "model") and (attr != "recipe" or args.command == "eval")
        check_text(f"{args.command} {'--' + attr.replace('_', '-') if optional else attr}", value,
                   as_file_name=True)


def _main(argv: list[str] | None) -> int:
    # Expandable segments let the caching allocator grow segments instead of leaving freed ones
    # stranded: on an H100, (d) NeuZip + LOMO at batch 1 used 15.28 instead of 15.57 GiB of device
    # memory and ran 1.7% faster at batch 8 (benchmarks/memory/results.jsonl).
    # Set before torch touches CUDA; a user's own PYTORCH_CUDA_ALLOC_CONF wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # neutrain reads models and data from disk only (recipes name local directories or hub ids already in the
    # cache, checked by neutrain.config.local_models): no library it drives may try the network. Set before
    # huggingface_hub, transformers or datasets are imported (they read it once); a user's own setting wins.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    argv = _argv_with_default_command(list(sys.argv[1:] if argv is None else argv))
    refusal = _unknown_command(argv)
    if refusal is not None:
        print_error(refusal)
        return EXIT_USER_ERROR
    parser = _parser(_command_named(argv))
    try:
        args = _parse(parser, argv)
    except FlagError as exc:  # a numeric flag's text (neutrain.config.numbers): one line, no usage text
        print_error(str(exc))
        return EXIT_USER_ERROR
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    args.given = given_options(parser, args.command, argv)  # which options were typed, not defaulted
    try:  # every NEUTRAIN_* variable, before any is used (neutrain.config.knobs)
        unknown = check_environment()
        level = knob("NEUTRAIN_LOG_LEVEL")
    except UserInputError as exc:
        print_error(one_line(exc))
        return EXIT_USER_ERROR
    # neutrain's own lines at the chosen level; other libraries' only from WARNING on, unless asked for DEBUG:
    # their INFO lines (datasets: "JAX version 0.11.2 available.") say nothing a user can act on.
    logging.basicConfig(level=level if level <= logging.DEBUG else max(level, logging.WARNING),
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("neutrain").setLevel(level)
    for line in unknown:
        logging.getLogger("neutrain").warning("%s", line)
    quiet_progress_bars()  # a log file or pipe gets lines, not carriage-return bar redraws
    if args.command != "recipes":  # every command that loads a model may import DeepSpeed (through transformers)
        name_cpu_accelerator()
    try:
        check_launch_environment(os.environ)  # before Accelerate parses them
        check_path_arguments(args)
        code = command_module(args.command).run(args)
        flush_stdout()  # a full stdout is reported here, as stdout's, not at interpreter exit
        return code
    except UserInputError as exc:
        if _debug():
            raise
        _refuse(one_line(exc), getattr(exc, "main_rank_only", False))
        return EXIT_USER_ERROR
    except StoppedBySignal as exc:  # SIGTERM/SIGINT: the checkpoint is saved (neutrain.trainer.signals)
        print_error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        print_error("interrupted", prefix="neutrain: ")
        return 130
    except StdoutError as exc:  # not the run's disk: the stream the command prints to
        print_error(str(exc))
        return EXIT_ENVIRONMENT
    except Exception as exc:
        # A full disk or read-only file system reaches here as OSError, or wrapped by safetensors / torch.save.
        if _debug():
            raise
        cause = exc
        while cause is not None and not isinstance(cause, StdoutError):  # wrapped by a library on its way up
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            print_error(str(cause))
            return EXIT_ENVIRONMENT
        if "torch" in sys.modules:  # a device out of memory: the phase it happened in, the budget, the plan
            from neutrain.memory import out_of_memory_line  # lazy: imports torch, loaded already here

            line = out_of_memory_line(exc)
            if line is not None:
                print_error(line)
                return EXIT_ENVIRONMENT
        from neutrain.data.chat import describe_template_error  # lazy: `neutrain --help` stays instant

        line = describe_template_error(exc)  # a chat template met while rendering (generate, eval)
        if line is not None:
            where = getattr(args, "model", None)
            print_error(f"{f'{where}: ' if where else ''}{line}")
            return EXIT_USER_ERROR
        line = describe_environment_error(exc, getattr(args, "writes_to", None) or getattr(args, "output", None))
        if line is not None:
            print_error(line)
            return EXIT_ENVIRONMENT
        if isinstance(exc, OSError):  # no errno: a library's "not found / not a model" report about user input
            print_error(one_line(exc))
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
