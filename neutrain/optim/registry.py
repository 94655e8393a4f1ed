"""The fused optimizers a recipe may name (``train.optimizer``): one :class:`OptimizerSpec` each.

Everything that depends on which optimizer runs reads its spec here instead of keying a table of its own
by name: the recipe check (the name), the factory (the class), the trainer (which ``TrainingArguments``
feed it), the memory planner and the disk check (the bytes of its state), the step-time model (its passes
over memory) and the planner's streamed vocabulary gradient (whether the update is element-wise).

A new optimizer is one file with its :class:`~neutrain.optim.fused.FusedOptimizer` subclass and one
:func:`register_optimizer` call: below, for one that ships with neutrain, or anywhere before the recipe is
loaded for one of your own::

    register_optimizer(OptimizerSpec("lion", "my_package.lion:Lion", elementwise=True,
                                     state=StateCost(per_element=4), arguments={"betas": ("adam_beta1", "adam_beta2")}))

Why this module imports no torch: the recipe check and the planner run before torch is imported (a bad
recipe is refused in well under a second, ``neutrain estimate`` needs no torch at all), and the package
root imports this module so that every recipe is checked against every registered name. So a spec names
its class as ``"module:attribute"``, imported on the first build; a class passed itself works as well.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import FUSED_OPTIMIZERS, OPTIMIZERS


@dataclass(frozen=True)
class StateCost:
    """Bytes of optimizer state per trained tensor, as the memory planner and the disk check count them.

    Args:
        per_element: bytes per element of every trained tensor (a full moment in fp32: 4; AdamW's two: 8).
        factored: bytes per row plus per column of each matrix, and per element of each vector (a factored
            second moment: AdaLomo keeps one fp32 statistic per row and per column, a full one for vectors).

    Example:
        >>> StateCost(factored=4).bytes(elements=4 * 6 + 6, matrices=[(4, 6)], vector_elements=6)
        64.0
    """

    per_element: float = 0.0
    factored: float = 0.0

    def bytes(self, elements: int, matrices: Iterable[tuple[int, int]], vector_elements: int) -> float:
        """The state of a model with ``elements`` trained elements: ``matrices`` as (rows, columns), beside
        ``vector_elements`` in vectors. ``matrices`` is read only for a factored state (the planner's list
        of every layer's matrices is long for deep models)."""
        total = float(self.per_element * elements)
        if self.factored:
            total += self.factored * (sum(rows + cols for rows, cols in matrices) + vector_elements)
        return total


@dataclass(frozen=True)
class OptimizerSpec:
    """One fused optimizer: what every part of a run needs to know of it.

    Args:
        name: the recipe's ``train.optimizer`` value.
        factory: the :class:`~neutrain.optim.fused.FusedOptimizer` subclass, or ``"module:attribute"`` naming
            it; called as ``factory(param_groups, lr=..., **options)``.
        elementwise: the update of an element reads only that element's gradient and state, so a weight may
            be updated a row block at a time (the streamed vocabulary update); must equal the class's
            ``elementwise``, which the first build checks.
        state: the bytes of its state (:class:`StateCost`; none by default).
        arguments: its hyperparameters that a run takes from ``TrainingArguments``: keyword -> the field,
            or a tuple of fields for a tuple value (the recipe's ``train.adam_beta1`` and ``adam_beta2``
            become ``betas``). Others keep the class's defaults.
        update_passes: weight-sized passes over device memory per update (reading the weight and its
            gradient, writing the weight: 3; each full moment read and written adds 2), for the step-time model.
    """

    name: str
    factory: str | Callable[..., Any]
    elementwise: bool
    state: StateCost = StateCost()
    arguments: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    update_passes: int = 3

    def resolve(self) -> Callable[..., Any]:
        """The class, imported if the spec names it; refused if its ``elementwise`` says otherwise."""
        factory = self.factory
        if isinstance(factory, str):
            module, _, attribute = factory.partition(":")
            factory = getattr(importlib.import_module(module), attribute)
        declared = getattr(factory, "elementwise", self.elementwise)
        if declared != self.elementwise:
            raise ValueError(f"fused optimizer {self.name!r}: registered with elementwise={self.elementwise}, "
                             f"but {getattr(factory, '__name__', factory)}.elementwise is {declared}")
        return factory

    def options(self, args: Any) -> dict[str, Any]:
        """The hyperparameters :attr:`arguments` names, read from ``args`` (a ``TrainingArguments``).

        Example:
            >>> from types import SimpleNamespace
            >>> optimizer_spec("adamw-in-backward").options(SimpleNamespace(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8))
            {'betas': (0.9, 0.95), 'eps': 1e-08}
        """
        return {keyword: tuple(getattr(args, f) for f in fields) if isinstance(fields, tuple) else getattr(args, fields)
                for keyword, fields in self.arguments.items()}


_SPECS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Make ``spec.name`` a recipe's ``train.optimizer`` value; a name taken already is refused."""
    if spec.name in OPTIMIZERS:
        raise ValueError(f"optimizer {spec.name!r} is registered already; choose another name")
    _SPECS[spec.name] = spec
    FUSED_OPTIMIZERS.add(spec.name)
    return spec


def unregister_optimizer(name: str) -> None:
    """Undo :func:`register_optimizer` (a test's own optimizer, once the test is done)."""
    del _SPECS[name]
    FUSED_OPTIMIZERS.remove(name)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of fused optimizer ``name``; ``ValueError`` naming the registered ones for any other name."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown fused optimizer {name!r}; choose one of {', '.join(_SPECS)}") from None


def optimizer_specs() -> tuple[OptimizerSpec, ...]:
    """Every registered fused optimizer, in registration order."""
    return tuple(_SPECS.values())


# ---------------------------------------------------------------- the optimizers neutrain ships
register_optimizer(OptimizerSpec(
    "lomo", "neutrain.optim.lomo:LOMO", elementwise=True))
register_optimizer(OptimizerSpec(
    "adalomo", "neutrain.optim.adalomo:AdaLomo", elementwise=False, state=StateCost(factored=4)))
register_optimizer(OptimizerSpec(
    "adamw-in-backward", "neutrain.optim.adamw:AdamWInBackward", elementwise=True, state=StateCost(per_element=8),
    arguments={"betas": ("adam_beta1", "adam_beta2"), "eps": "adam_epsilon"}, update_passes=7))
