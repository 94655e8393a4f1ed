"""Which decoder layers ``neutrain generate`` keeps on the GPU under a device budget, and which it streams.

Why: a card that holds most of a model's compressed layers but not all of them streamed every layer from
host memory (Llama-3-8B on one H200: 3.97 GiB allocated under a 9 GiB budget, as under 5 GiB). At batch 1
each token needs every layer, so each layer streamed is its payload over PCIe for every token; keeping
what fits on the card is what sets the decode rate.

:func:`decide` resolves it once, before anything is read, into one :class:`Residency`: the first of

1. ``dense``: the weights as stored, every layer on the GPU (fastest decode);
2. ``neuzip``: NeuZip lossless, every layer on the GPU (bit-exact);
3. ``neuzip+offload``: NeuZip lossless with the fewest decoder layers streamed from host memory that fit
   (each streamed layer is one more payload over the link per token, so fewer is always faster),

whose predicted peak reserved bytes (:func:`neutrain.memory.phase_planner.generation_plan`: the build and
the generation, the resident layers, the store's slots and the decode buffers counted as the training
step counts them, plus the KV cache of the longest prompt and its new tokens) leave
:data:`~neutrain.memory.fit.FIT_HEADROOM` of the budget, as the training's fit does. More budget never
keeps fewer layers resident: each candidate either fits a budget or not, and a larger budget fits every
candidate a smaller one did. A budget that holds not even every layer streamed is refused in one line.

Which layers stream: those :meth:`~neutrain.config.layer_placement.LayerPlacement.spread` picks for
training's ``memory.offload_layers``, the middle one of each of k equal runs. Spread apart, each
streamed layer's copy is fetched while the resident layers before it compute (the ring fetches one ahead),
where a contiguous tail would make its layers wait on copies back to back with nothing to hide them; and
one placement for both keeps one store, one ring, and the planner's numbers for both.

Example:
    >>> from neutrain.memory.planner import ModelShape
    >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
    >>> print(decide(shape, 9 * GIB, prompt_tokens=16, new_tokens=112).line)
    NeuZip lossless weights (bit-exact), keeping 18 of 32 decoder layers on the GPU, streaming 14 from host memory (3.87 GiB over PCIe a token); predicted peak 8.49 GiB reserved, budget 9.00 GiB
    >>> decide(shape, 22 * GIB, prompt_tokens=16, new_tokens=112).form
    'dense'
"""

from __future__ import annotations

from dataclasses import dataclass

from neutrain.config.layer_placement import LayerPlacement
from neutrain.errors import UserInputError
from neutrain.memory.fit import FIT_HEADROOM
from neutrain.memory.phase_planner import generation_plan, peak_phase, predicted_gib
from neutrain.memory.placement import Placement
from neutrain.memory.planner import GIB, NEUZIP_BITS, Estimate
from neutrain.memory.shape import ModelShape

WORDS = {"dense": "dense weights", "neuzip": "NeuZip lossless weights", "neuzip+offload": "NeuZip lossless weights"}


@dataclass(frozen=True)
class Residency:
    """Where a generation's weights live: the form, the decoder layers streamed from host memory, the prediction.

    Attributes:
        form: ``dense``, ``neuzip`` or ``neuzip+offload``.
        layers: decoder layers in the model.
        streamed: indices of the layers streamed from host memory, ascending (empty but for ``neuzip+offload``).
        phase: the phase of the predicted peak (``build`` or ``generate``).
        predicted: that phase's estimate (``predicted.reserved``: the bytes the budget must hold).
        budget: the budget decided against, in bytes (None: none).
        positions: the positions one sequence may hold (prompt plus new tokens), the KV cache planned.
        layer_bytes: one streamed layer's payload, copied over PCIe once a token.
    """

    form: str
    layers: int
    streamed: tuple[int, ...]
    phase: str
    predicted: Estimate
    budget: int | None
    positions: int
    layer_bytes: float = 0.0

    @property
    def resident(self) -> int:
        return self.layers - len(self.streamed)

    @property
    def link_bytes_per_token(self) -> float:
        """Bytes copied from host memory for each token decoded (every streamed layer once)."""
        return len(self.streamed) * self.layer_bytes

    @property
    def line(self) -> str:
        """The decision in words: the form, what stays and what streams, the predicted peak and the budget."""
        exact = " (bit-exact)" if self.form != "dense" else ""
        where = (f"{exact}, keeping {self.resident} of {self.layers} decoder layers on the GPU, streaming "
                 f"{len(self.streamed)} from host memory ({self.link_bytes_per_token / GIB:.2f} GiB over PCIe a token)"
                 if self.streamed else f" on the GPU{exact}, all {self.layers} decoder layers resident")
        budget = f"budget {self.budget / GIB:.2f} GiB" if self.budget is not None else "no budget"
        return f"{WORDS[self.form]}{where}; predicted peak {self.predicted.reserved / GIB:.2f} GiB reserved, {budget}"

    @property
    def placement(self) -> Placement:
        """The decision the generation's build acts on: the form, the layers streamed, the prediction."""
        return Placement("dense" if self.form == "dense" else "neuzip-lossless", self.layers, self.streamed,
                         budget=self.budget, peak_phase=self.phase, peak_reserved=self.predicted.reserved,
                         phases=predicted_gib({self.phase: self.predicted}), lines=(self.line,))

    def summary(self) -> dict:
        """The decision as numbers (for a run's summary or a benchmark record)."""
        return {"form": self.form, "layers": self.layers, "resident_layers": self.resident,
                "streamed_layers": len(self.streamed), "streamed": list(self.streamed), "phase": self.phase,
                "predicted_reserved_gib": round(self.predicted.reserved / GIB, 3),
                "budget_gib": None if self.budget is None else round(self.budget / GIB, 3),
                "positions": self.positions, "link_gib_per_token": round(self.link_bytes_per_token / GIB, 3)}


def candidates(layers: int, dense: bool):
    """``(form, streamed count)`` in the order tried: fastest decode first."""
    if dense:
        yield "dense", 0
    yield "neuzip", 0
    for count in range(1, layers + 1):
        yield "neuzip+offload", count


def decide(shape: ModelShape, budget: int | None, *, prompt_tokens: int, new_tokens: int, batch: int = 1,
           dtype_bytes: int = 2, bits_per_weight: float = NEUZIP_BITS, weight_scale: float = 1.0, dense: bool = True,
           encoded: bool = False, extra: dict[str, float] | None = None,
           setting: str = "--device-budget-gib") -> Residency:
    """The :class:`Residency` of a generation of ``new_tokens`` after ``prompt_tokens`` (``batch`` rows) under
    ``budget`` bytes (None: no budget), by the rule of the module docstring.

    Args:
        weight_scale: the model's weight bytes over those ``shape`` counts, when more (files holding tensors the
            build does not make, or a shape read in closed form): every weight term is scaled by it, so a layer is
            counted at its real size.
        dense: the dense form may be taken (a compressed run's checkpoint is placed compressed).
        encoded, extra: as :func:`~neutrain.memory.phase_planner.generation_plan` takes them.
        setting: how the budget was given, for the refusal's line.

    Raises:
        UserInputError: not even every layer streamed fits the budget (one line: the budget and the one needed).
    """
    smallest, scale = None, max(1.0, weight_scale)
    beyond = {"weights beyond the shape": (scale - 1) * shape.params() * dtype_bytes} if scale > 1 else {}
    for form, count in candidates(shape.layers, dense):
        more = {**(extra or {}), **(beyond if form == "dense" else {})}
        plan = generation_plan(shape, weights="dense" if form == "dense" else "neuzip-lossless", streamed=count,
                               prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch, dtype_bytes=dtype_bytes,
                               bits_per_weight=bits_per_weight * scale, encoded=encoded, extra=more)
        phase, worst = peak_phase(plan)
        if budget is None or worst.reserved <= budget * (1 - FIT_HEADROOM):
            return Residency(form, shape.layers, _spread(shape.layers, count), phase, worst, budget,
                             prompt_tokens + new_tokens, worst.settings.get("layer_bytes", 0.0))
        if smallest is None or worst.reserved < smallest[1].reserved:
            smallest = (phase, worst, count)
    phase, worst, count = smallest
    raise UserInputError(
        f"{setting}: {budget / GIB:.2f} GiB is too small to generate with this model: the smallest placement "
        f"({count} of {shape.layers} decoder layers streamed from host memory, {prompt_tokens + new_tokens} positions) "
        f"needs a budget of {worst.reserved / (1 - FIT_HEADROOM) / GIB:.2f} GiB (predicted peak "
        f"{worst.reserved / GIB:.2f} GiB reserved in phase '{phase}', {FIT_HEADROOM:.0%} left free)")


def _spread(layers: int, count: int) -> tuple[int, ...]:
    if not count:
        return ()
    return LayerPlacement.spread(layers, count).offloaded
