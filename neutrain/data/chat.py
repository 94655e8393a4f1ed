"""Chat templates: the tokenizer's own, or a named one for a tokenizer that has none.

A recipe's ``data.chat_template`` is ``null`` (the tokenizer's template, as instruct models and
GGUF files carry it), a name from :data:`NAMED_TEMPLATES`, or an inline Jinja template. The chosen
template is set on the tokenizer, so checkpoints and the export carry it and ``neutrain generate``
formats prompts the way the model was trained (:func:`prompt_ids`).

Example:
    >>> from neutrain.data import byte_tokenizer
    >>> tok = set_chat_template(byte_tokenizer(), "chatml")
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from neutrain.compat.native_panics import native_panics
from neutrain.data.template_bounds import TemplateCostError, bounded_rendering, check_template_bounds
from neutrain.errors import RecipeError, UserInputError

# Prefix-stable templates (each message renders the same whatever follows), which assistant-only
# masking needs. Markers that are not tokens of the vocabulary are learnt as ordinary text.
NAMED_TEMPLATES = {
    # ChatML (Qwen, SmolLM2, many fine-tunes).
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Zephyr-style: role tags, each turn closed by the tokenizer's own EOS token (so the model stops on it).
    "zephyr": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
}


def is_inline_template(value: str) -> bool:
    """True for a Jinja template written inline rather than a name."""
    return "{{" in value or "{%" in value


def check_chat_template(value: str | None) -> None:
    """Refuse a ``data.chat_template`` that is neither a known name nor Jinja (at recipe load time).

    Example:
        >>> check_chat_template("chatlm")
        Traceback (most recent call last):
        neutrain.errors.RecipeError: data.chat_template: 'chatlm' is not a template name (chatml, zephyr) nor a Jinja template. Did you mean 'chatml'?
    """
    if value is None or value in NAMED_TEMPLATES or is_inline_template(value):
        return
    import difflib

    match = difflib.get_close_matches(value, list(NAMED_TEMPLATES), n=1)
    hint = f" Did you mean '{match[0]}'?" if match else ""
    raise RecipeError(f"data.chat_template: '{value}' is not a template name ({', '.join(NAMED_TEMPLATES)}) "
                      f"nor a Jinja template.{hint}")


def set_chat_template(tokenizer, value: str | None):
    """Set ``data.chat_template`` on ``tokenizer`` (``None`` keeps the tokenizer's own); returns it.

    Raises:
        RecipeError: for a value that is neither a known name nor Jinja (:func:`check_chat_template`), or a
            template whose rendering is not bounded (:func:`~neutrain.data.template_bounds.check_template_bounds`).
    """
    check_chat_template(value)
    if value is not None:
        tokenizer.chat_template = NAMED_TEMPLATES.get(value, value)
    # Before any row is rendered with it: a template's cost is bounded (neutrain.data.template_bounds).
    check_template_bounds(tokenizer, "data.chat_template" if value is not None else "the tokenizer's chat template")
    return tokenizer


def trained_on_chat(datasets: list[dict]) -> bool:
    """True when a recipe's ``data.datasets`` hold chat data (``type: messages``), i.e. the model is trained
    on text rendered by the chat template, so generation should render prompts the same way.

    Example:
        >>> trained_on_chat([{"path": "python-stdlib", "type": "text"}]), trained_on_chat([{"type": "messages"}])
        (False, True)
    """
    return any(entry.get("type") == "messages" for entry in datasets or ())


def template_choice(tokenizer, trained_with_template: bool | None, raw: bool = False) -> tuple[bool, str]:
    """``(use the chat template?, why)`` for a generation prompt.

    Why: a model trained from scratch on code got its prompt wrapped in the byte tokenizer's
    template, which it never saw, and printed only ``#``. The template is used only when the tokenizer has
    one and the model was trained with it: ``trained_with_template`` is what the run recorded (``None``
    for a model neutrain did not train, e.g. an instruct GGUF, which was trained with its own template).

    Example:
        >>> from neutrain.data import byte_tokenizer
        >>> template_choice(byte_tokenizer(), trained_with_template=False)
        (False, 'no chat template: the model was trained on raw text')
        >>> template_choice(byte_tokenizer(), trained_with_template=True)
        (True, "chat template: the model's own (it was trained with it)")
    """
    if raw:
        return False, "no chat template: --raw"
    if not getattr(tokenizer, "chat_template", None):
        return False, "no chat template: the tokenizer has none"
    if trained_with_template is False:
        return False, "no chat template: the model was trained on raw text"
    if trained_with_template is None:
        return True, "chat template: the model's own (not trained by neutrain)"
    return True, "chat template: the model's own (it was trained with it)"


def prompt_ids(tokenizer, prompt: str | list[dict], raw: bool = False) -> list[int]:
    """Token ids for a generation prompt: one user turn in the chat template plus the assistant header.

    ``raw`` (or a tokenizer without a chat template) tokenizes the text as it is. ``prompt`` may also be a
    conversation, ``[{"role": ..., "content": ...}, ...]`` ending with a user turn (``neutrain chat``).

    Example:
        >>> from neutrain.data import byte_tokenizer
        >>> tok = byte_tokenizer()
        >>> tok.decode(prompt_ids(tok, "hi"))
        '<|bos|>user\\nhi<|eos|><|bos|>assistant\\n'
        >>> tok.decode(prompt_ids(tok, "hi", raw=True))
        'hi'
    """
    panic = lambda message: UserInputError(tokenizer_panic("--prompt", message))  # noqa: E731
    if raw or not getattr(tokenizer, "chat_template", None):
        with native_panics(panic):
            return list(tokenizer(prompt if isinstance(prompt, str) else prompt[-1]["content"])["input_ids"])
    check_template_bounds(tokenizer, "the model's chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        with bounded_rendering():  # this prompt, under the bounds the probe was checked with
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateCostError as exc:
        raise UserInputError(f"--prompt: the model's chat template {exc} on this prompt (its cost depends on the "
                             "text); use --raw, or a template that only formats the messages") from None
    # The template writes its own BOS/special tokens: adding them again would double them.
    with native_panics(panic):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_panic(where: str, message: str) -> str:
    """The line for a tokenizer whose native code panicked on ``where``'s text (``message``: the panic's).

    Example:
        >>> tokenizer_panic("d.jsonl: row 4", "Onig: Regex search error: retry-limit-in-match over")
        "d.jsonl: row 4: the tokenizer's native code stopped on this text (Onig: Regex search error: retry-limit-in-match over): a regex of its normalizer or pre-tokenizer backtracks without end here; fix the tokenizer's regex, or drop the text"
    """
    return (f"{where}: the tokenizer's native code stopped on this text ({message}): a regex of its normalizer or "
            "pre-tokenizer backtracks without end here; fix the tokenizer's regex, or drop the text")


def describe_template_error(exc: BaseException) -> str | None:
    """One line for an error a chat template raised while rendering, else None (not a template error).

    Why: Jinja's errors reached the user as tracebacks, and a template the sandbox refused looked
    like a crash although the sandbox had done its job. Syntax errors and unknown filters show only
    when the template is first rendered (transformers compiles it then).

    Example:
        >>> import jinja2
        >>> describe_template_error(jinja2.TemplateSyntaxError("unexpected '}'", lineno=1))
        "the chat template is not valid Jinja (line 1: unexpected '}')"
    """
    try:
        import jinja2
        from jinja2.sandbox import SecurityError
    except ImportError:  # no jinja2: nothing could have rendered a template
        return None
    message = " ".join(str(exc).split())
    if not isinstance(exc, jinja2.TemplateError):
        # Any other error raised by the template's own code (``{{ 1/0 }}``, ``{{ text + 1 }}``): Jinja puts the
        # template's lines in the traceback as frames of the file "<template>".
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<template>":
            tb = tb.tb_next
        if tb is None:
            return None
        return f"the chat template raised an error while rendering (line {tb.tb_lineno}: {type(exc).__name__}: {message})"
    if isinstance(exc, SecurityError):
        return (f"the chat template tried an operation the sandbox forbids ({message}); the sandbox refused it and "
                "nothing unsafe ran: use a template that only formats the messages")
    if isinstance(exc, jinja2.TemplateSyntaxError):  # its str() repeats the line number: take the message alone
        return f"the chat template is not valid Jinja (line {exc.lineno}: {' '.join(str(exc.message).split())})"
    return f"the chat template raised an error while rendering ({type(exc).__name__}: {message})"
