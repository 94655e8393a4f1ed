"""Bounding what a chat template may cost to render, checked once before any data is rendered with it.

Why: a chat template is code from a recipe or a downloaded model, and Jinja's sandbox stops escapes
but not expansion: ``{{ 'x' * 10**9 }}``, nested ``range`` loops, a namespace value doubled in a loop
or a content repeated a million times made every row render for minutes or take gigabytes.
:func:`check_template_bounds` renders the template once, on a short probe conversation, in
transformers' own environment (:mod:`neutrain.compat.chat_templates`) with limits: no value over
:data:`MAX_VALUE` characters (``*``, ``+``, calls, namespace values), at most :data:`MAX_LOOP_STEPS`
``range`` steps, and an output of at most :data:`OUTPUT_FACTOR` times the conversation's text plus
:data:`OUTPUT_SLACK` characters. A template over a limit is refused in one line; one that cannot
render the probe at all is left to the rendering of the data, which reports its own error.

Example:
    >>> from neutrain.data import byte_tokenizer
    >>> tok = byte_tokenizer()
    >>> check_template_bounds(tok)  # the byte tokenizer's own template: cheap
    >>> tok.chat_template = "{{ 'x' * 1000000000 }}"
    >>> check_template_bounds(tok)
    Traceback (most recent call last):
    neutrain.errors.RecipeError: data.chat_template: the chat template builds a value of 1,000,000,000 items (more than 1,048,576); ...
"""

from __future__ import annotations

import math

from neutrain.errors import RecipeError

MAX_VALUE = 1 << 20
MAX_LOOP_STEPS = 1_000_000
OUTPUT_FACTOR = 64
OUTPUT_SLACK = 1 << 16
_PROBE = [{"role": role, "content": f"probe {role} text " * 8} for role in ("user", "assistant", "user", "assistant")]


class _TooCostly(Exception):
    """What the bounded environment raises: the template went past a limit (the message says which)."""


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else None


def _check_value(value, what: str = "builds a value"):
    size = _size(value)
    if size is not None and size > MAX_VALUE:
        raise _TooCostly(f"{what} of {size:,} items (more than {MAX_VALUE:,})")
    return value


def _bounded(env) -> None:
    """Limit ``env`` (a template environment overlay) in place: values, loop steps, namespace writes."""
    table = env.binop_table
    steps = [0]

    def call_binop(context, operator, left, right):
        if operator == "*":  # a sequence repeated: refused before it is built
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and _size(seq) is not None and len(seq) * count > MAX_VALUE:
                raise _TooCostly(f"builds a value of {len(seq) * count:,} items (more than {MAX_VALUE:,})")
        if operator == "**" and all(isinstance(x, (int, float)) for x in (left, right)) and abs(left) > 1 \
                and abs(right) * math.log2(abs(left)) > 4096:
            raise _TooCostly(f"computes {left} ** {right} (more than 4096 bits)")
        return _check_value(table[operator](left, right))

    call = env.call

    def bounded_call(context, obj, *args, **kwargs):
        if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_VALUE for a in (*args, *kwargs.values())):
            raise _TooCostly(f"calls {getattr(obj, '__name__', 'a function')} with a size over {MAX_VALUE:,}")
        return _check_value(call(context, obj, *args, **kwargs))

    def counted_range(*args):
        for value in range(*args):
            steps[0] += 1
            if steps[0] > MAX_LOOP_STEPS:
                raise _TooCostly(f"loops more than {MAX_LOOP_STEPS:,} times")
            yield value

    namespace = env.globals.get("namespace")
    if isinstance(namespace, type):
        class BoundedNamespace(namespace):
            def __setitem__(self, name, value):
                super().__setitem__(name, _check_value(value, f"stores in namespace.{name} a value"))

        env.globals["namespace"] = BoundedNamespace
    env.intercepted_binops = frozenset(("*", "**", "+"))
    env.call_binop, env.call = call_binop, bounded_call
    env.globals["range"] = counted_range


def check_template_bounds(tokenizer, where: str = "data.chat_template") -> None:
    """Refuse ``tokenizer``'s chat template when rendering a short conversation goes past a limit (module doc).

    Raises:
        RecipeError: naming ``where`` and the limit.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return
    import jinja2  # lazy: only templates need it

    from neutrain.compat.chat_templates import template_environment  # lazy: imports transformers

    try:
        env = template_environment()
        _bounded(env)
        compiled = env.from_string(template)
    except jinja2.TemplateError:
        return  # not valid Jinja: the rendering of the data names the error
    text = sum(len(m["content"]) for m in _PROBE)
    limit = OUTPUT_FACTOR * text + OUTPUT_SLACK
    rendered = 0
    special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    try:
        for chunk in compiled.generate(messages=_PROBE, add_generation_prompt=True, **special):
            rendered += len(chunk)
            if rendered > limit:
                raise _TooCostly(f"writes more than {limit:,} characters for a {len(_PROBE)}-message conversation of "
                                 f"{text} characters")
    except _TooCostly as exc:
        raise RecipeError(f"{where}: the chat template {exc}; rendering every row of the data would take unbounded "
                          f"time or memory: use a template that only formats the messages") from None
    except Exception:  # the template refuses this probe (raise_exception, a missing key): the data's rendering reports
        return
