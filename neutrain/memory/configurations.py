"""The configurations the automatic fit chooses among: the recipe keys each changes, its label, its estimate.

The levers, each tried only where the recipe leaves its key to the fit (:attr:`Recipe.explicit`; for the
weights, ``memory.weights: auto``):

* ``memory.weights``: dense or NeuZip lossless. Lossless compression changes memory and speed, never the
  result (the same bits a step), so this is the fit's to choose;
* ``memory.offload_activations`` (checkpointed layers' inputs in host memory; needs
  ``memory.gradient_checkpointing``);
* ``memory.offload_weights`` with ``memory.offload_layers: k``: k decoder layers in host memory, spread
  between resident ones (:class:`~neutrain.config.layer_placement.LayerPlacement`), the others trained
  on the GPU as before; k runs from the fewest that save anything (more layers than the store's slots)
  to every layer; NeuZip lossless, a fused optimizer, no accumulation;
* both;
* then a smaller ``train.micro_batch_size`` with ``train.gradient_accumulation_steps`` raised to keep the
  rows per optimizer step (halving until one row), activations offloaded where allowed;
* only where none of those fits (:func:`tight_configurations`): each of them again with the gated MLP in
  chunks of tokens (``memory.mlp_chunk_tokens``, :data:`MLP_CHUNKS`) and, where every layer streams, two weight
  slots on the GPU instead of four (``memory.offload_slots``). Both cost time (smaller products, more launches,
  less look-ahead for the copies), so a budget that fits without them keeps today's configuration.

The embedding and lm_head are no lever: the loss decodes the lm_head whole, so its payload (0.67 GiB for
the 8B) would be on the device beside its decoded copy at the step's peak anyway; keeping both
vocabulary matrices in host memory lowers that peak by the embedding's payload alone, while a step
copies them in and out (about 3 GiB for the 8B) at its two ends, where no compute overlaps. Five spread
decoder layers (two slots) save more, 0.79 GiB, for about 0.6 GiB of waiting.

Example:
    >>> from neutrain.config import load_recipe
    >>> [c.label for c in configurations(load_recipe("llama3_8b"), gpu=False)]
    ['dense weights in memory', 'NeuZip weights in memory']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neutrain.config.layer_placement import LayerPlacement
from neutrain.config.schema import FUSED_OPTIMIZERS, Recipe
from neutrain.config.validate import check_weight_offload
from neutrain.errors import RecipeError
from neutrain.memory.planner import Estimate, estimate_recipe
from neutrain.memory.shape import ModelShape, recipe_shape

AUTO = "auto"
WEIGHTS = ("dense", "neuzip-lossless")
"""What ``memory.weights: auto`` resolves to: the two storages that train the same model."""
WEIGHTS_LABEL = {"dense": "dense weights", "neuzip-lossless": "NeuZip weights"}


def apply_changes(recipe: Recipe, changes: dict[str, Any]) -> Recipe:
    """The recipe with a fit's ``{"section.key": value}`` changes (named so, as the fit reports them) made through
    :meth:`Recipe.changed`, which refuses a key its section does not have."""
    by_section: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        by_section.setdefault(section, {})[key] = value
    return recipe.changed(**by_section)


def weight_options(recipe: Recipe) -> list[str]:
    """The storages the fit may give the weights: the recipe's own, or for ``auto`` dense and, where the
    recipe could train it (a fused optimizer, or a frozen base under an adapter), NeuZip lossless.

    Example:
        >>> from neutrain.config import load_recipe
        >>> weight_options(load_recipe("llama3_8b")), weight_options(load_recipe("llama3_8b", ["memory.weights=dense"]))
        (['dense', 'neuzip-lossless'], ['dense'])
    """
    m, t = recipe.memory, recipe.train
    if m.weights != AUTO:
        return [m.weights]
    if m.adapter is None and t.optimizer not in FUSED_OPTIMIZERS:
        return ["dense"]  # NeuZip weights are updated inside backward
    if t.fsdp or t.deepspeed or t.distributed in ("fsdp2", "deepspeed"):
        return ["dense"]  # sharding splits dense weights only
    return list(WEIGHTS)


def valid(recipe: Recipe) -> bool:
    """Whether the recipe's memory keys compose (what validation would accept of them)."""
    m, t = recipe.memory, recipe.train
    if m.offload_activations and not m.gradient_checkpointing:
        return False
    if m.mlp_chunk_tokens not in (AUTO, 0) and (m.adapter is not None or t.fsdp or t.deepspeed
                                               or t.distributed in ("fsdp2", "deepspeed")):
        return False  # adapters wrap the projections, sharding gathers them per module: the MLP runs whole
    if m.offload_weights:
        if m.weights != "neuzip-lossless":
            return False
        try:
            check_weight_offload(m, t, t.optimizer in FUSED_OPTIMIZERS)
        except RecipeError:
            return False
    elif m.offload_layers is not None:
        return False
    return True


def placement_label(recipe: Recipe, layers: int, gpu: bool = True) -> str:
    """What a configuration keeps in host memory, in words (the fit's one line and ``memory_fit.choice``);
    on a CPU (``gpu=False``) nothing is offloaded: ``in memory``.

    Example:
        >>> from neutrain.config import load_recipe
        >>> placement_label(load_recipe("llama3_8b", ["memory.offload_weights=true", "memory.offload_layers=8"]), 32)
        "offloading 8 of 32 decoder layers' weights"
    """
    m = recipe.memory
    if not m.offload_weights:
        return "offloading activations" if m.offload_activations else "on the GPU" if gpu else "in memory"
    if m.offload_layers is None or m.offload_layers >= layers:
        return "offloading weights and activations" if m.offload_activations else "offloading weights"
    part = f"{m.offload_layers} of {layers} decoder layers' weights"
    return f"offloading activations and {part}" if m.offload_activations else f"offloading {part}"


def layer_counts(layers: int) -> list[int | None]:
    """``memory.offload_layers`` values worth trying: those that free more than their slots take, then all."""
    counts = [k for k in range(1, layers)
              if k > min(LayerPlacement.spread(layers, k).slots, k) * (1 + 1 / 16)]
    return [*counts, None]


MLP_CHUNKS = (4096, 2048, 1024, 512)
"""Chunk sizes the fit tries, largest first: 4096 tokens keep each product large enough to run near the GEMM
rate (a 4096 x 8192 by 8192 x 28672 product is 1.9 TFLOP), and below 512 a layer's launches per chunk would
cost more than the products save."""
TIGHT_SLOTS = 2
"""Weight slots the fit tries under a tight budget: the current layer and the one fetched ahead."""


def gated_mlp(shape: ModelShape) -> bool:
    """Whether every decoder layer has the gated MLP :mod:`neutrain.nn.chunked_mlp` chunks (no expert stack)."""
    if shape.per_layer is None:
        return True
    for table in shape.per_layer:
        names = [name for name, _ in table]
        if any("expert" in n for n in names) or not all(any(n.endswith(f"{p}.weight") for n in names)
                                                        for p in ("gate_proj", "up_proj", "down_proj")):
            return False
    return True


def _value(recipe: Recipe, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(recipe, section), key)


@dataclass
class Candidate:
    """One configuration: its label, family (what it is, the number of streamed layers aside), the keys it
    changes, the recipe with them, and its training step's estimate."""

    label: str
    family: tuple
    changes: dict[str, Any]
    recipe: Recipe
    train: Estimate

    @property
    def weights(self) -> str:
        return self.recipe.memory.weights


def configurations(recipe: Recipe, shape: ModelShape | None = None, gpu: bool = True,
                   levers: bool = True, tight: bool = False) -> list[Candidate]:
    """Every configuration the fit may take (see the module docstring); explicit keys are left out of the
    changes, and configurations the explicit keys make the same are listed once.

    ``gpu=False`` (a CPU: host and device memory are one) offloads nothing; ``levers=False`` varies the
    weights alone (no device budget: the recipe's other keys stay as they are); ``tight=True`` gives
    :func:`tight_configurations`'s instead.
    """
    if shape is None:
        shape = recipe_shape(recipe)
    auto = recipe.memory.weights == AUTO
    none = {"memory.offload_activations": False, "memory.offload_weights": False, "memory.offload_layers": None}
    offload = [none]
    if gpu and levers:
        offload.append({**none, "memory.offload_activations": True})
        offload += [{"memory.offload_activations": act, "memory.offload_weights": True, "memory.offload_layers": k}
                    for act in (False, True) for k in layer_counts(shape.layers)]
    if not levers:
        offload = [{}]
    seen: set[tuple] = set()
    found: list[Candidate] = []

    def take(changes: dict[str, Any], prefix: str = "") -> None:
        changes = {k: v for k, v in changes.items() if k not in recipe.explicit or (k == "memory.weights" and auto)}
        chosen = apply_changes(recipe, changes)
        m, t = chosen.memory, chosen.train
        layers = m.offload_layers if m.offload_layers is not None and m.offload_layers < shape.layers else None
        key = (m.weights, m.offload_activations, m.offload_weights, layers if m.offload_weights else None,
               t.micro_batch_size, t.gradient_accumulation_steps, m.mlp_chunk_tokens,
               m.offload_slots if m.offload_weights else None)
        if not valid(chosen) or key in seen:
            return
        if (m.offload_weights and m.offload_slots and "memory.offload_slots" in changes
                and LayerPlacement.spread(shape.layers, m.offload_layers).slots <= m.offload_slots):
            return  # no fewer slots than the store's own ring
        seen.add(key)
        changes = {k: v for k, v in changes.items() if v != _value(recipe, k)}  # what it really changes
        label = prefix + placement_label(chosen, shape.layers, gpu) + _tight_label(chosen)
        if auto:
            label = f"{WEIGHTS_LABEL[m.weights]} {label}" if label in ("on the GPU", "in memory") \
                else f"{WEIGHTS_LABEL[m.weights]}, {label}"
        family = (m.weights, m.offload_activations, m.offload_weights, t.micro_batch_size, m.mlp_chunk_tokens,
                  m.offload_slots)
        found.append(Candidate(label, family, changes, chosen, estimate_recipe(chosen, shape)))

    t = recipe.train
    rows = t.micro_batch_size * t.gradient_accumulation_steps
    # Both keys change together (the rows per step stay): either one set by the user rules this out.
    batch_keys_free = levers and not {"train.micro_batch_size", "train.gradient_accumulation_steps"} & recipe.explicit
    squeezes = [{}]
    if tight:
        chunks = [c for c in MLP_CHUNKS if c < rows * recipe.data.sequence_len] if gated_mlp(shape) else []
        slots = [None, TIGHT_SLOTS]
        squeezes = [{"memory.mlp_chunk_tokens": c, "memory.offload_slots": k} for c in [AUTO, *chunks] for k in slots]
        squeezes = squeezes[1:]  # the first is what the untight configurations tried
    for weights in weight_options(recipe):
        for changes in offload:
            for squeeze in squeezes:
                if squeeze.get("memory.offload_slots") and not changes.get("memory.offload_weights"):
                    continue  # slots are the weight store's
                take({"memory.weights": weights, **changes, **squeeze})
        mb = t.micro_batch_size
        while batch_keys_free and mb > 1 and mb % 2 == 0:
            mb //= 2
            for changes in offload[:2]:  # weight offload does not accumulate
                batch = {"train.micro_batch_size": mb, "train.gradient_accumulation_steps": rows // mb}
                for squeeze in squeezes:
                    if not squeeze.get("memory.offload_slots"):
                        take({"memory.weights": weights, **changes, **batch, **squeeze},
                             f"micro_batch_size {mb} x {rows // mb} accumulation steps ({rows} rows a step), ")
    if tight:
        found = [c for c in found if c.recipe.memory.mlp_chunk_tokens != AUTO
                 or (c.recipe.memory.offload_weights and c.recipe.memory.offload_slots)]
    return found


def tight_configurations(recipe: Recipe, shape: ModelShape | None = None, gpu: bool = True) -> list[Candidate]:
    """The configurations the fit tries when none of :func:`configurations`' fits: each of those again with the
    gated MLP chunked and, where weights stream, the store's ring cut to two slots (keys the recipe sets
    explicitly stay as they are)."""
    return configurations(recipe, shape, gpu, levers=True, tight=True)


def _tight_label(recipe: Recipe) -> str:
    m = recipe.memory
    words = []
    if m.offload_weights and m.offload_slots:
        words.append(f"{m.offload_slots} weight slots on the GPU")
    if m.mlp_chunk_tokens not in (AUTO, 0):
        words.append(f"the MLP in chunks of {m.mlp_chunk_tokens} tokens")
    return (", " + ", ".join(words)) if words else ""
