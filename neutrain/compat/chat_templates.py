"""transformers' chat-template sandbox, as an environment neutrain may bound.

transformers renders chat templates in an ``ImmutableSandboxedEnvironment`` of its own, with its
filters (``tojson``), globals (``raise_exception``, ``namespace``, ``strftime_now``) and extensions
(``{% generation %}``, loop controls), built by the private ``_compile_jinja_template``. To check what
a template costs to render (:mod:`neutrain.data.template_bounds`) neutrain renders it in the very same
environment, and that is reached only here.

Example:
    >>> env = template_environment()
    >>> env.from_string("{{ 'a' | tojson }}").render()
    '"a"'
"""

from __future__ import annotations


def template_environment():
    """A copy (Jinja overlay) of the environment transformers compiles chat templates in.

    Its ``globals`` and ``filters`` are the overlay's own dictionaries, so changing them leaves transformers'
    cached environment as it was. The environment comes from compiling an empty template: compiling a hostile
    one there would already run it in part (Jinja folds constant expressions such as ``'x' * 10**9``).
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = base.overlay()
    env.globals, env.filters = dict(base.globals), dict(base.filters)
    return env
