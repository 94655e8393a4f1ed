"""The one decision the memory planning ends in: where each part of a model lives, and why.

Why one object: the training fit (:func:`neutrain.memory.fit.choose_fit`) and the generation's residency
(:func:`neutrain.memory.residency.decide`) both decide the same things (the weights' form, which decoder
layers stream from host memory, the activations, the predicted peak against a budget), and the trainer,
the model build and ``neutrain generate`` act on them. Each reads them from a :class:`Placement` instead of
working them out again from recipe keys or dicts, so what is built is what was planned.

Example:
    >>> p = Placement("neuzip-lossless", layers=32, streamed=(2, 6, 10), budget=11 * 2**30,
    ...               peak_phase="train_step", peak_reserved=10.3 * 2**30)
    >>> p.offload_weights, p.resident, p.build_placement("cpu").layers
    (True, 29, 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

GIB = 2**30


@dataclass(frozen=True)
class Placement:
    """Where a model's memory goes, as planned.

    Attributes:
        weights: the weights' form: ``dense`` or ``neuzip-*``.
        layers: decoder layers in the model.
        streamed: indices of the decoder layers whose compressed weights live in host memory and are
            streamed to the device, ascending (empty: every layer stays on the device).
        offload_activations: the checkpointed layers' saved inputs live in host memory (training).
        activation_device_layers: of those, the last this many layers' stay on the device (the fit's split
            for a short host: :mod:`neutrain.memory.tiers`).
        activation_file_layers: the first this many layers' go on to a file under the run's folder.
        activation_file_bytes: the bytes that file holds (the run's disk check counts them).
        micro_batch_size: rows of a training micro-batch (None: a generation).
        budget: the device budget fitted to, in bytes (None: none).
        peak_phase: the phase of the predicted peak.
        peak_reserved: its predicted reserved bytes (what the budget must hold).
        phases: each phase's predicted peak (GiB: ``allocated``, ``reserved``, ``device``).
        host_bytes: host memory pinned for what is offloaded.
        lines: the reason lines the run prints for this decision.
    """

    weights: str
    layers: int
    streamed: tuple[int, ...] = ()
    offload_activations: bool = False
    activation_device_layers: int = 0
    activation_file_layers: int = 0
    activation_file_bytes: float = 0.0
    micro_batch_size: int | None = None
    budget: int | None = None
    peak_phase: str = ""
    peak_reserved: float = 0.0
    phases: Mapping[str, Mapping[str, float]] = field(default_factory=dict, compare=False)
    host_bytes: float = 0.0
    lines: tuple[str, ...] = ()

    @property
    def compressed(self) -> bool:
        return self.weights != "dense"

    @property
    def offload_weights(self) -> bool:
        """Some decoder layers' weights live in host memory."""
        return bool(self.streamed)

    @property
    def resident(self) -> int:
        """Decoder layers whose weights stay on the device."""
        return self.layers - len(self.streamed)

    def build_placement(self, device: Any = "cpu"):
        """The build's :class:`~neutrain.nn.model_spec.Placement` of this decision on ``device``: the same
        form, and as many decoder layers in host memory, spread as the planner spread them."""
        from neutrain.nn.model_spec import Placement as BuildPlacement  # lazy: torch, which a plan never needs

        return BuildPlacement(self.weights, offload=self.offload_weights,
                              layers=len(self.streamed) if self.streamed else None, device=device)

    def as_dict(self) -> dict[str, Any]:
        """The decision as numbers (a run's summary, a benchmark record)."""
        return {"weights": self.weights, "layers": self.layers, "resident_layers": self.resident,
                "streamed": list(self.streamed), "offload_activations": self.offload_activations,
                "activation_device_layers": self.activation_device_layers,
                "activation_file_layers": self.activation_file_layers,
                "activation_file_gib": self.activation_file_bytes / GIB,
                "micro_batch_size": self.micro_batch_size,
                "budget_gib": None if self.budget is None else self.budget / GIB,
                "peak_phase": self.peak_phase, "predicted_reserved_gib": self.peak_reserved / GIB,
                "host_gib": self.host_bytes / GIB, "lines": list(self.lines)}
