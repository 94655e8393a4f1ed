"""The open sets of names a recipe key may take: optimizers and KV caches that higher packages register."""

from __future__ import annotations

from collections.abc import Sequence


class Names(Sequence[str]):
    """The values a recipe key may take that a higher package defines, in the order they were registered.

    Why open: the recipe sits below the packages that implement fused optimizers and KV caches, so it cannot
    list them; each registry (``neutrain.optim.registry``, ``neutrain.eval.kv.registry``) adds a name here as it
    registers an implementation, and the package root imports both registries before any recipe is read.
    Read live: a check sees every name registered before it runs.

    Example:
        >>> caches = Names("full")
        >>> caches.add("paged")
        >>> list(caches), "paged" in caches
        (['full', 'paged'], True)
    """

    def __init__(self, *fixed: str, then: Names | None = None):
        self._fixed, self._added, self._then = tuple(fixed), [], then

    def add(self, name: str) -> None:
        if name in self:
            raise ValueError(f"{name!r} is registered already")
        self._added.append(name)

    def remove(self, name: str) -> None:
        self._added.remove(name)

    def _all(self) -> tuple[str, ...]:
        return (*self._fixed, *self._added, *(self._then or ()))

    def __getitem__(self, index):
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"Names{self._all()}"


# The names a recipe may give train.optimizer, eval.kv_caches and eval.long_context_tasks: the Trainer's own optimizers, then what the
# registries add (validation, the trainer and the planner read these).
FUSED_OPTIMIZERS = Names()  # update inside backward: neutrain.optim.registry
OPTIMIZERS = Names("adamw", "sgd", then=FUSED_OPTIMIZERS)
KV_CACHES = Names()  # eval.kv_caches: neutrain.eval.kv.registry
LONG_CONTEXT_TASKS = Names()  # eval.long_context_tasks: neutrain.eval.tasks
