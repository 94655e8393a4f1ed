"""A chat template's rendering is bounded on every thread, not only the main one.

Why: the time limit of a rendering came from a timer (``SIGALRM``), which only the main thread has; a loop whose body
runs no attribute, item, call or operator (nested ``{% for %}`` over a message's text, or over a string the template
built) ran nothing the budget counted, so rendering in any other thread (a server's, a data loader's) ran for hours.
Every loop step is now a step of the budget: each loop shape, rendered for a row or a prompt and for the probe,
on the main thread and on a worker thread, is refused in one line within seconds.
"""

from __future__ import annotations

import threading

import pytest

NESTED = "{% for a in S %}{% for b in S %}{% for c in S %}{% endfor %}{% endfor %}{% endfor %}"
SHAPES = {
    "nested loops over the text": NESTED,
    "loops with a test": "{% for a in S if a %}{% for b in S if b %}{% for c in S if c %}{% endfor %}{% endfor %}"
                         "{% endfor %}",
    "loops over a list": NESTED.replace("S", "L"),
    "loops using loop.index": "{% for a in S %}{% for b in S %}{% for c in S %}{{ '' if loop.index else '' }}"
                              "{% endfor %}{% endfor %}{% endfor %}",
    "a recursive loop": "{% for m in messages recursive %}" + NESTED + "{% endfor %}",
    "loops with an else": NESTED.replace("{% endfor %}", "{% else %}{% endfor %}"),
}
SOURCES = {  # what S (and L, its characters) is: the message's text, or a string the template builds
    "the message's text": "{% set S = messages[0]['content'] | string %}{% set L = S | list %}",
    "a built string": "{% set S = 'ab' * 4000 %}{% set L = S | list %}",
}


def _in_thread(work, on_main: bool):
    """``work()``'s result or exception, on this thread or a worker; None if it ran past 60 s."""
    box: dict = {}

    def run():
        try:
            box["result"] = work()
        except Exception as exc:  # noqa: BLE001 (the refusal is what is looked at)
            box["error"] = exc

    if on_main:
        run()
    else:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(60)
    return box


@pytest.mark.parametrize("on_main", [False, True], ids=["worker thread", "main thread"])
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_loop_that_counts_nothing_is_refused_on_any_thread(shape, source, on_main):
    from neutrain.data import byte_tokenizer
    from neutrain.data.template_bounds import TemplateCostError, bounded_rendering

    tok = byte_tokenizer()
    tok.chat_template = SOURCES[source] + SHAPES[shape] + "x"

    def render():
        with bounded_rendering():
            return tok.apply_chat_template([{"role": "user", "content": "y" * 3000}], tokenize=False)

    box = _in_thread(render, on_main)
    assert box, "the rendering ran past 60 s: it is not bounded on this thread"
    assert isinstance(box.get("error"), TemplateCostError), box


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_probe_refuses_a_loop_over_a_built_string_on_a_worker_thread_naming_the_template(shape):
    from neutrain.data import byte_tokenizer
    from neutrain.data.template_bounds import check_template_bounds
    from neutrain.errors import RecipeError

    tok = byte_tokenizer()
    tok.chat_template = SOURCES["a built string"] + SHAPES[shape] + "x"
    box = _in_thread(lambda: check_template_bounds(tok), on_main=False)
    assert box, "the probe ran past 60 s: it is not bounded on this thread"
    error = box.get("error")
    assert isinstance(error, RecipeError) and str(error).startswith("data.chat_template: the chat template"), box


def test_a_template_that_loops_over_its_messages_still_renders():
    from neutrain.data import byte_tokenizer
    from neutrain.data.template_bounds import bounded_rendering

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {% for c in m.content %}{{ c }}{% endfor %}\n"
                         "{% else %}none{% endfor %}{% for m in messages recursive %}.{% endfor %}")
    box = _in_thread(lambda: _render(tok, bounded_rendering), on_main=False)
    assert box.get("result") == "user: helloassistant: hi there..", box  # (the newline after a tag is trimmed)


def _render(tok, bounded_rendering):
    with bounded_rendering():
        return tok.apply_chat_template([{"role": "user", "content": "hello"},
                                        {"role": "assistant", "content": "hi there"}], tokenize=False)
