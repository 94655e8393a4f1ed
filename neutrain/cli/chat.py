"""``neutrain chat``: talk to a model loaded once, each message a user turn of its chat template.

Why: ``neutrain generate`` loads the model for every prompt, and a conversation is many prompts that each
carry the ones before. Here the model (an export, a checkpoint, a run's output_dir or a GGUF file, as for
``generate``) is loaded once; each line read from stdin is a user turn, the whole conversation goes
through the chat template, and the reply is printed and kept for the next turn. A model trained on raw
text (no template, or ``--raw``) continues each line on its own instead, with no history. When the
conversation no longer fits the model's context, the oldest turns are dropped (stderr says so). End of
input (Ctrl-D) or Ctrl-C ends the chat, exit 0.

Example:
    >>> fit_history([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
    ...              {"role": "user", "content": "c"}], fits=lambda m: len(m) <= 1)
    ([{'role': 'user', 'content': 'c'}], 2)
"""

from __future__ import annotations

import sys
from typing import Callable

from neutrain.cli.generate import (add_device_arguments, add_model_argument, add_sampling_arguments, check_arguments, decode,
                                   load_for_generation)
from neutrain.errors import UserInputError


def configure(p) -> None:
    """The ``chat`` command's description and arguments, on its subparser ``p``."""
    p.description = ("Load MODEL once and answer each line of stdin as a user turn of a conversation in "
                     "the model's chat template (greedy unless --temperature > 0). Ctrl-D or Ctrl-C ends it.")
    add_model_argument(p)
    p.add_argument("--system", help="a system message opening the conversation (where the chat template has one)")
    p.add_argument("--raw", action="store_true", help="no chat template: continue each line as it is, without history")
    add_sampling_arguments(p)
    add_device_arguments(p)


def fit_history(messages: list[dict], fits: Callable[[list[dict]], bool]) -> tuple[list[dict], int]:
    """The conversation without its oldest turns until ``fits(messages)``; returns it and how many were dropped.

    A system message stays; turns go in pairs (a user turn and its reply) so the conversation still starts
    with a user turn. Raises when even the last user turn alone does not fit.
    """
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns, dropped = messages[len(system):], 0
    while not fits(system + turns):
        if len(turns) <= 1:
            raise UserInputError("the message alone is longer than the model's context; send a shorter one")
        turns, dropped = turns[2:], dropped + 2
    return system + turns, dropped


MAX_LINE_CHARS = 1 << 22
"""The longest line of stdin a turn may be (4 Mi characters, past any model's context): a stdin with no newline
(``< /dev/zero``) was read into memory without end and never answered."""


def _read(prompt: str) -> str | None:
    """The next line of stdin without its newline; None at end of input."""
    if prompt:
        print(prompt, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline(MAX_LINE_CHARS + 1)
    if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
        raise UserInputError(f"chat: a line of stdin runs past {MAX_LINE_CHARS:,} characters with no newline: a turn "
                             "is one line of text (is stdin a device or a binary file?)")
    return None if line == "" else line.rstrip("\n")


def run(args) -> int:
    """Chat with ``args.model`` until the end of stdin or Ctrl-C."""
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.cli.generate import check_context  # lazy: same reason
    from neutrain.data.chat import prompt_ids  # lazy: same reason

    check_arguments(args)
    loaded = load_for_generation(args)
    tokenizer, history = loaded.tokenizer, loaded.use_template
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    if loaded.residency is not None:  # on a GPU: the positions whose KV cache the placement holds
        context = min(context, loaded.residency.positions) if isinstance(context, int) else loaded.residency.positions
    mode = "each line is a user turn of the conversation" if history else "each line is continued on its own"
    print(f"[{loaded.why}; {mode}; Ctrl-D or Ctrl-C ends]", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system and history else []
    prompt = "> " if sys.stdin.isatty() else ""
    try:
        while (line := _read(prompt)) is not None:
            if not line.strip():
                continue
            turn = [*messages, {"role": "user", "content": line}] if history else [{"role": "user", "content": line}]

            def fits(m: list[dict]) -> bool:
                return not isinstance(context, int) or len(prompt_ids(tokenizer, m, raw=not history)) + args.max_new_tokens <= context

            try:
                turn, dropped = fit_history(turn, fits)
            except UserInputError as exc:
                print(f"neutrain: {exc}", file=sys.stderr)
                continue
            if dropped:
                print(f"[the {dropped} oldest turns no longer fit the context of {context} positions: dropped]",
                      file=sys.stderr)
            ids = torch.tensor([prompt_ids(tokenizer, turn, raw=not history)])
            check_context(loaded.model, ids.shape[1], args.max_new_tokens)
            out, _ = decode(loaded, ids, args)
            reply = tokenizer.decode(out[0, ids.shape[1]:].cpu(), skip_special_tokens=True).strip()
            print(reply, flush=True)
            if history:
                messages = [*turn, {"role": "assistant", "content": reply}]
    except KeyboardInterrupt:  # Ctrl-C ends the chat as Ctrl-D does, mid-answer too
        print(file=sys.stderr)
    return 0
