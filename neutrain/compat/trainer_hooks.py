"""Touch points of ``transformers.Trainer`` internals and ``TrainingArguments`` drift, each a named adapter.

* :func:`make_training_arguments` builds ``TrainingArguments``, leaving out only the keywords
  known to exist in some supported releases and not others (listed in
  :data:`VERSION_DEPENDENT_KEYWORDS`); any other unknown keyword is a bug and raises.
* :func:`checkpoint_dir_redirected` points ``Trainer._save_checkpoint`` at a temporary
  directory (``Trainer._get_output_dir`` is the one seam it reads the run directory from),
  so a checkpoint appears under its real name only once complete.

Example:
    >>> from neutrain.compat.trainer_hooks import make_training_arguments
    >>> args = make_training_arguments({"output_dir": "out", "save_safetensors": True, "use_cpu": True})
    >>> args.output_dir
    'out'
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

VERSION_DEPENDENT_KEYWORDS = frozenset({"save_safetensors"})
"""``save_safetensors``: in transformers 5.17, gone in 5.2x (safetensors is then the only format)."""


def make_training_arguments(kwargs: dict[str, Any], cls: Any = None) -> Any:
    """``TrainingArguments(**kwargs)`` minus the version-dependent keywords this release does not know.

    Raises:
        TypeError: for an unknown keyword that is not version-dependent (a typo must not vanish).
    """
    if cls is None:
        from transformers import TrainingArguments as cls  # lazy: keep `import neutrain.compat` free of transformers

    accepted = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if bad := [k for k in unknown if k not in VERSION_DEPENDENT_KEYWORDS]:
        raise TypeError(f"TrainingArguments of this transformers release has no keyword(s) {bad}")
    if unknown:
        logger.debug("TrainingArguments: %s not in this transformers release, left out", unknown)
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


@contextlib.contextmanager
def checkpoint_dir_redirected(trainer: Any, directory: str) -> Iterator[None]:
    """Within the block, ``trainer`` saves its checkpoint's run directory as ``directory``."""
    if not callable(getattr(type(trainer), "_get_output_dir", None)):
        raise RuntimeError("transformers.Trainer has no _get_output_dir: update "
                           "neutrain.compat.trainer_hooks.checkpoint_dir_redirected for this release")
    trainer._get_output_dir = lambda trial=None: directory
    try:
        yield
    finally:
        del trainer._get_output_dir
