"""Bounding what a chat template may cost to render: once on a probe before any data, then on every conversation.

Why: a chat template is code from a recipe or a downloaded model, and Jinja's sandbox stops escapes
but not expansion: ``{{ 'x' * 10**9 }}``, nested ``range`` loops, a namespace value doubled in a loop
or a content repeated a million times made every row render for minutes or take gigabytes. A check on a
probe conversation alone was not enough: a loop gated on a message's content (``{% if 'x' in
message.content %}``) costs nothing on the probe and hung ``generate`` on the prompt that held an ``x``.

Both renderings go through transformers' own environment (:mod:`neutrain.compat.chat_templates`) with
limits: no value over :data:`MAX_VALUE` characters (``*``, ``+``, ``%``, calls, filters, namespace values, and no
size, width or precision over it before a value is built), at most
:data:`MAX_LOOP_STEPS` ``range`` steps, and at most :data:`RENDER_SECONDS` of rendering, checked at every
attribute, item, call, operator and loop step the template runs, on any thread (and, in the main thread, also
by a timer).

Each rendering is also bounded by the size of what it renders (:func:`input_size`: the characters and items
of its messages and other arguments), not by a constant alone: at most :data:`OPS_FACTOR` operations
(attributes, items, calls, operators, filters) and :data:`OUTPUT_FACTOR` characters of output per unit of
input, plus a slack, and macros nested at most :data:`MAX_CALL_DEPTH` deep. Why: the constant bounds held
each row to seconds, so a template whose macro recursed on the content, or which wrote many small values in
a loop, cost seconds and megabytes on every row: hours and gigabytes over a data set, with no row refused.

* :func:`check_template_bounds` renders the template once, on a short probe conversation, also bounding
  its output to :data:`OUTPUT_FACTOR` times the conversation's text plus :data:`OUTPUT_SLACK` characters;
  a template over a limit is refused in one line before the data is read; one that cannot render the probe
  at all is left to the rendering of the data, which reports its own error.
* :func:`bounded_rendering` is the block inside which ``apply_chat_template`` renders a row or a prompt
  under the same limits; going past one raises :class:`TemplateCostError`, which the caller names (the row,
  the prompt).

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

import contextlib
import functools
import math
import re
import signal
import threading
import time

from neutrain.compat.chat_templates import compiled_with, template_environment
from neutrain.errors import RecipeError

MAX_VALUE = 1 << 20
MAX_LOOP_STEPS = 1_000_000
OUTPUT_FACTOR = 64
OUTPUT_SLACK = 1 << 16
OPS_FACTOR = 64
OPS_SLACK = 1 << 17
MAX_CALL_DEPTH = 64
"""Macros calling macros: a template's own nesting is a few levels; deeper is recursion on the content."""
RENDER_SECONDS = 10.0
"""Rendering one conversation (all its prefixes, for a training row) takes milliseconds; ten seconds is a loop."""
_PROBE = [{"role": role, "content": f"probe {role} text " * 8} for role in ("user", "assistant", "user", "assistant")]


class TemplateCostError(Exception):
    """A chat template went past a rendering limit (the message says which, starting with a verb: "loops ...")."""


class _TooCostly(TemplateCostError):
    """Raised inside the template's own code by the bounded environment."""


class _Budget:
    """The loop steps and time one rendering has left."""

    def __init__(self):
        self.steps, self.deadline, self.seconds = 0, math.inf, 0.0
        self.ops, self.op_limit, self.output_limit, self.size, self.depth = 0, math.inf, math.inf, 0, 0

    def start(self, seconds: float) -> None:
        self.steps, self.seconds, self.deadline = 0, seconds, time.monotonic() + seconds

    def limit_to(self, size: int) -> None:
        """Bound the rendering about to start by ``size``, its input's (:func:`input_size`)."""
        self.ops, self.depth, self.size = 0, 0, size
        self.op_limit, self.output_limit = OPS_FACTOR * size + OPS_SLACK, OUTPUT_FACTOR * size + OUTPUT_SLACK

    def tick(self) -> None:
        self.ops += 1
        if self.ops > self.op_limit:
            self.op_limit = math.inf  # said once
            raise _TooCostly(f"runs more than {OPS_FACTOR * self.size + OPS_SLACK:,} operations for an input of "
                             f"{self.size:,} characters and items")
        if time.monotonic() > self.deadline:
            self.deadline = math.inf  # said once
            raise _TooCostly(f"takes more than {self.seconds:g} s to render one conversation")


def input_size(value) -> int:
    """The characters and items of ``value`` (a rendering's arguments, at every depth): what its cost is held to.

    Example:
        >>> input_size({"messages": [{"role": "user", "content": "hello"}]})
        36
    """
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        size += 1
        if isinstance(item, (str, bytes)):
            size += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return size


class _BoundedTemplate:
    """A compiled template whose every rendering is held to its input's size: output, operations, depth."""

    def __init__(self, template, budget: _Budget):
        self._template, self._budget = template, budget

    def __getattr__(self, name):  # environment, blocks, ...: the template's own
        return getattr(self._template, name)

    def generate(self, *args, **kwargs):
        budget = self._budget
        budget.limit_to(input_size((args, kwargs)))
        limit, written = budget.output_limit, 0
        for chunk in self._template.generate(*args, **kwargs):
            written += len(chunk)
            if written > limit:
                raise _TooCostly(f"writes more than {limit:,} characters for an input of {budget.size:,} characters "
                                 "and items")
            yield chunk

    def render(self, *args, **kwargs) -> str:
        return "".join(self.generate(*args, **kwargs))


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else None


def _check_value(value, what: str = "builds a value"):
    size = _size(value)
    if size is not None and size > MAX_VALUE:
        raise _TooCostly(f"{what} of {size:,} items (more than {MAX_VALUE:,})")
    return value


_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_sizes(args, what: str) -> None:
    """Refuse a size (an integer argument, or a width or precision in a format string) over :data:`MAX_VALUE`
    before the value it sizes is built. Why: ``'x'|center(10**9)``, ``'%1000000000s' % x`` and
    ``'{:>1000000000}'.format(x)`` build a gigabyte in one C call, past any check made after it."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > MAX_VALUE:
            raise _TooCostly(f"{what} with a size over {MAX_VALUE:,}")
        if isinstance(arg, str) and ("%" in arg or "{" in arg):
            digits = [d for m in _PERCENT_SPEC.finditer(arg) for d in m.groups() if d] + \
                [d for m in _BRACE_SPEC.finditer(arg) for d in re.findall(r"\d+", m.group(1))]
            if any(len(d) > 7 or int(d) > MAX_VALUE for d in digits):
                raise _TooCostly(f"{what} with a format width over {MAX_VALUE:,}")


def _bounded_filter(name: str, function, budget: _Budget):
    """``function`` (a Jinja filter) with its sizes checked before it runs and its value after."""
    @functools.wraps(function)  # keeps jinja_pass_arg: Jinja passes the context or environment as before
    def bounded(*args, **kwargs):
        budget.tick()
        _check_sizes((*args, *kwargs.values()), f"applies the filter {name}")
        return _check_value(function(*args, **kwargs))

    return bounded


def _bounded(env, budget: _Budget) -> None:
    """Limit ``env`` (a template environment overlay) in place: values, loop steps, namespace writes, time."""
    from jinja2.runtime import Macro  # lazy: only templates need it

    table = env.binop_table

    def call_binop(context, operator, left, right):
        budget.tick()
        if operator == "*":  # a sequence repeated: refused before it is built
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and _size(seq) is not None and len(seq) * count > MAX_VALUE:
                raise _TooCostly(f"builds a value of {len(seq) * count:,} items (more than {MAX_VALUE:,})")
        if operator == "%" and isinstance(left, str):  # printf-style formatting: its widths size the value
            _check_sizes((left, *(right if isinstance(right, tuple) else (right,))), "formats a string")
        if operator == "**" and all(isinstance(x, (int, float)) for x in (left, right)) and abs(left) > 1 \
                and abs(right) * math.log2(abs(left)) > 4096:
            raise _TooCostly(f"computes {left} ** {right} (more than 4096 bits)")
        return _check_value(table[operator](left, right))

    call, getattr_, getitem = env.call, env.getattr, env.getitem

    def bounded_call(context, obj, *args, **kwargs):
        if obj is counted_iter:  # a loop's items (the code generator's own call): the items themselves are no size
            return counted_iter(*args)
        budget.tick()
        # 'text {:>9}'.format(...): the widths are in the string (the sandbox wraps str.format, keeping __wrapped__)
        owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        _check_sizes((*args, *kwargs.values(), *((owner,) if isinstance(owner, str) else ())),
                     f"calls {getattr(obj, '__name__', 'a function')}")
        if not isinstance(obj, Macro):
            return _check_value(call(context, obj, *args, **kwargs))
        budget.depth += 1
        try:  # a macro calling itself: refused at a depth no template's own nesting reaches
            if budget.depth > MAX_CALL_DEPTH:
                raise _TooCostly(f"calls its macros more than {MAX_CALL_DEPTH} deep (recursion on the content)")
            return _check_value(call(context, obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    def counted_range(*args):
        for value in range(*args):
            budget.steps += 1
            if budget.steps > MAX_LOOP_STEPS:
                raise _TooCostly(f"loops more than {MAX_LOOP_STEPS:,} times")
            if budget.steps % 1024 == 0:
                budget.tick()
            yield value

    def timed_getattr(obj, attribute):
        budget.tick()
        return getattr_(obj, attribute)

    def timed_getitem(obj, argument):
        budget.tick()
        return getitem(obj, argument)

    def counted_iter(iterable):
        """A ``{% for %}`` loop's items, each one a step of the budget (its time and its operations); a ``range``
        counts its own steps (:data:`MAX_LOOP_STEPS`)."""
        if getattr(iterable, "gi_code", None) is counted_range.__code__:
            return iterable
        return _counted(iterable)

    def _counted(iterable):
        for value in iterable:
            budget.tick()
            yield value

    env.code_generator_class = _counted_loops_generator()
    env.neutrain_counted_iter = counted_iter
    namespace = env.globals.get("namespace")
    if isinstance(namespace, type):
        class BoundedNamespace(namespace):
            def __setitem__(self, name, value):
                super().__setitem__(name, _check_value(value, f"stores in namespace.{name} a value"))

        env.globals["namespace"] = BoundedNamespace
    env.filters = {name: _bounded_filter(name, function, budget) for name, function in env.filters.items()}
    env.intercepted_binops = frozenset(("*", "**", "+", "%"))
    env.call_binop, env.call = call_binop, bounded_call
    env.getattr, env.getitem = timed_getattr, timed_getitem
    env.globals["range"] = counted_range


@functools.lru_cache(maxsize=1)
def _counted_loops_generator():
    """Jinja's code generator, with every ``{% for %}`` loop's iterable passed through the environment's
    ``neutrain_counted_iter``: each item is a step of the budget.

    Why: a loop whose body runs no attribute, item, call or operator (``{% for a in s %}{% for b in s %}{% endfor
    %}{% endfor %}`` over a message's text) ran nothing the budget saw; only a timer stopped it, and a timer
    (``SIGALRM``) exists in the main thread alone, so rendering in any other thread (a server, a data loader's
    thread) ran for hours. Counted at every item, a loop is bounded by the rendering's time and operations
    wherever it runs.
    """
    from jinja2 import nodes  # lazy: only templates need it
    from jinja2.compiler import CodeGenerator

    class CountedLoops(CodeGenerator):
        def visit_For(self, node, frame):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("neutrain_counted_iter", lineno=node.lineno),
                                   [node.iter], [], None, None, lineno=node.lineno)
            super().visit_For(node, frame)

    return CountedLoops


@contextlib.contextmanager
def _alarm(seconds: float, budget: _Budget):
    """In the main thread, a timer besides the budget's own checks (every loop step is one); elsewhere nothing."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer") \
            or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN, None) \
            or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield  # another user of the timer (a test runner's timeout): the budget's own checks remain
        return

    def expired(signum, frame):
        budget.deadline = -math.inf
        budget.tick()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds + 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Renderer:
    """One bounded environment per process, its compiled templates, and the budget of the rendering under way."""

    def __init__(self):
        self.budget = _Budget()
        self.env = template_environment()
        _bounded(self.env, self.budget)
        self.compiled: dict[str, object] = {}

    def compile(self, template: str):
        found = self.compiled.get(template)
        if found is None:
            if len(self.compiled) > 16:
                self.compiled.clear()
            found = self.compiled[template] = _BoundedTemplate(self.env.from_string(template), self.budget)
        return found


_RENDERER: list[_Renderer] = []


@contextlib.contextmanager
def bounded_rendering(seconds: float | None = None):
    """Inside the block, ``tokenizer.apply_chat_template`` renders under the module's limits (values, loop
    steps, ``seconds`` in all, :data:`RENDER_SECONDS` by default); going past one raises :class:`TemplateCostError`.

    Example:
        >>> from neutrain.data import byte_tokenizer
        >>> tok = byte_tokenizer()
        >>> tok.chat_template = ("{% if 'loop' in messages[0]['content'] %}{% for i in range(10000) %}"
        ...                      "{% for j in range(10000) %}{% endfor %}{% endfor %}{% endif %}")
        >>> with bounded_rendering():
        ...     tok.apply_chat_template([{"role": "user", "content": "loop"}], tokenize=False)
        Traceback (most recent call last):
        neutrain.data.template_bounds.TemplateCostError: loops more than 1,000,000 times
    """
    if not _RENDERER:
        _RENDERER.append(_Renderer())
    renderer = _RENDERER[0]
    seconds = RENDER_SECONDS if seconds is None else seconds
    renderer.budget.start(seconds)
    try:
        with compiled_with(renderer.compile), _alarm(seconds, renderer.budget):
            yield
    except _TooCostly as exc:
        raise TemplateCostError(str(exc)) from None
    finally:
        renderer.budget.deadline = math.inf


def check_template_bounds(tokenizer, where: str = "data.chat_template") -> None:
    """Refuse ``tokenizer``'s chat template when rendering a short conversation goes past a limit (module doc).

    Raises:
        RecipeError: naming ``where`` and the limit.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return
    import jinja2  # lazy: only templates need it

    budget = _Budget()
    try:
        env = template_environment()
        _bounded(env, budget)
        compiled = env.from_string(template)
    except jinja2.TemplateError:
        return  # not valid Jinja: the rendering of the data names the error
    special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    budget.start(RENDER_SECONDS)
    try:
        with _alarm(RENDER_SECONDS, budget):
            for _chunk in _BoundedTemplate(compiled, budget).generate(messages=_PROBE, add_generation_prompt=True,
                                                                      **special):
                pass
    except _TooCostly as exc:
        raise RecipeError(f"{where}: the chat template {exc}; rendering every row of the data would take unbounded "
                          f"time or memory: use a template that only formats the messages") from None
    except Exception:  # the template refuses this probe (raise_exception, a missing key): the data's rendering reports
        return
