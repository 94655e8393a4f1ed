"""Which decoder layers ``memory.offload_layers`` puts in host memory, and the ring of device slots for them.

Plain arithmetic on a layer count: the planner and ``neutrain estimate`` fit a budget with it before torch is
imported, and the weight store (:mod:`neutrain.nn.weight_offload_model`) builds its ring from the same answer,
so the layers predicted and the layers streamed are one choice.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE_MODEL_RING = (2, 4)
"""``(ahead, slots)`` when (nearly) every layer is offloaded: adjacent layers stream back to back, so two are
fetched ahead (the 8B at 0.956x of in-GPU at batch 8, benchmarks/offload/results.jsonl#offload)."""
SPREAD_RING = (1, 2)
"""``(ahead, slots)`` when at most half the layers are offloaded: a resident layer separates any two of
them, so one fetched ahead has that layer's compute to arrive in, and two slots (the current layer and
the next) are enough; each slot spared is a layer's payload of device memory."""


@dataclass(frozen=True)
class LayerPlacement:
    """Which decoder layers live in host memory, and the store's ring of device slots for them.

    Attributes:
        layers: decoder layers in the model.
        offloaded: indices of the layers in host memory, ascending.
        ahead, slots: the :class:`~neutrain.nn.weight_offload.WeightOffload` ring.

    Example:
        >>> LayerPlacement.spread(32, 8).offloaded
        (2, 6, 10, 14, 18, 22, 26, 30)
        >>> p = LayerPlacement.spread(32)  # every layer
        >>> len(p.offloaded), (p.ahead, p.slots)
        (32, (2, 4))
    """

    layers: int
    offloaded: tuple[int, ...]
    ahead: int
    slots: int

    @classmethod
    def spread(cls, layers: int, count: int | None = None, slots: int | None = None) -> "LayerPlacement":
        """``count`` of ``layers`` decoder layers (None: all), spread evenly: the middle layer of each of
        ``count`` equal runs, so the offloaded layers are as far apart as they can be and each copy has
        the most resident compute to hide behind. ``slots`` (``memory.offload_slots``) replaces the ring's slots,
        fetching ``slots - 2`` layers ahead (at least one), as the store's default ring does.

        Raises:
            ValueError: ``count`` is not between 1 and ``layers``.
        """
        count = layers if count is None else int(count)
        if not 1 <= count <= layers:
            raise ValueError(f"cannot offload {count} of {layers} decoder layers (1 to {layers})")
        offloaded = tuple((2 * i + 1) * layers // (2 * count) for i in range(count))
        if slots is None:
            ahead, slots = SPREAD_RING if 2 * count <= layers else WHOLE_MODEL_RING
        else:
            ahead = max(1, slots - 2)
        return cls(layers, offloaded, ahead, slots)

    @property
    def count(self) -> int:
        return len(self.offloaded)
