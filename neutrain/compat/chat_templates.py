"""transformers' chat-template sandbox, as an environment neutrain may bound.

transformers renders chat templates in an ``ImmutableSandboxedEnvironment`` of its own, with its
filters (``tojson``), globals (``raise_exception``, ``namespace``, ``strftime_now``) and extensions
(``{% generation %}``, loop controls), built by the private ``_compile_jinja_template``. To check what
a template costs to render (:mod:`neutrain.data.template_bounds`) neutrain renders it in the very same
environment, and that is reached only here.

Rendering itself stays transformers' (``apply_chat_template``); :func:`compiled_with` only makes it
compile templates in such an environment for the duration of a block.

Example:
    >>> env = template_environment()
    >>> env.from_string("{{ 'a' | tojson }}").render()
    '"a"'
"""

from __future__ import annotations

import contextlib
from typing import Callable


def template_environment():
    """A copy (Jinja overlay) of the environment transformers compiles chat templates in.

    Its ``globals`` and ``filters`` are the overlay's own dictionaries, so changing them leaves transformers'
    cached environment as it was. The environment comes from compiling an empty template: compiling a hostile
    one there would already run it in part (Jinja folds constant expressions such as ``'x' * 10**9``).
    """
    import transformers.utils.chat_template_utils as utils

    compile_template = _REPLACED[-1] if _REPLACED else utils._compile_jinja_template  # transformers' own, in a block
    base = compile_template("").environment
    env = base.overlay()
    env.globals, env.filters = dict(base.globals), dict(base.filters)
    return env


@contextlib.contextmanager
def compiled_with(compile_template: Callable):
    """Inside the block, ``apply_chat_template`` compiles its template with ``compile_template`` (a template
    string -> a ``jinja2.Template``) instead of transformers' cached compiler; the compiler is restored after.

    Why: a template must render under neutrain's bounds for every conversation (a loop gated on a message's
    content escaped a check made once on a probe), and transformers looks its compiler up by module name at
    each call, so replacing it is the one seam that leaves transformers' rendering as it is.
    """
    import transformers.utils.chat_template_utils as utils

    original = utils._compile_jinja_template
    _REPLACED.append(_REPLACED[-1] if _REPLACED else original)
    utils._compile_jinja_template = compile_template
    try:
        yield
    finally:
        utils._compile_jinja_template = original
        _REPLACED.pop()


_REPLACED: list[Callable] = []
"""transformers' own compiler while :func:`compiled_with` has replaced it (what :func:`template_environment` copies)."""
