"""What a model build needs, resolved once: where the weights come from, the architecture, the
dtypes, the attention backend and where the weights go.

A recipe's ``model`` section, a checkpoint folder or a GGUF file is turned into one
:class:`ModelSpec` before anything is read (``neutrain.trainer.modeling.resolve_model`` for a
recipe); :func:`neutrain.nn.load.build` then streams the source's tensors into the placement
the spec names, and nothing downstream reads the recipe's dict again.

Example:
    >>> from transformers import LlamaConfig
    >>> from neutrain.nn.sources import RandomInit
    >>> spec = ModelSpec(RandomInit(seed=0), LlamaConfig(num_hidden_layers=2), torch.bfloat16,
    ...                  placement=Placement("neuzip-lossless", offload=True))
    >>> spec.placement.compressed, spec.stored_dtype
    (True, torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from neutrain.nn.convert import WEIGHT_MODES
from neutrain.nn.sources import TensorSource


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a built model's weights live and in which form.

    Args:
        weights: ``"dense"`` (plain parameters) or ``"neuzip-lossless"`` (compressed modules).
        offload: keep the compressed weights of the ``host`` modules in host memory, streamed in per
            module by a :class:`~neutrain.nn.weight_offload.WeightOffload` (compressed weights only).
        host: names of the modules whose compressed weights go to host memory, each handed over as one
            unit once all of its parameters are placed; ``None``: the decoder layers ``layers`` names.
        layers: with ``host`` None, how many decoder layers go to host memory, spread evenly through the
            model (``memory.offload_layers``, :meth:`~neutrain.config.layer_placement.LayerPlacement.spread`,
            whose ring of device slots the store then gets); ``None``: every layer.
        slots: with ``host`` None, the store's device slots (``memory.offload_slots``); ``None``: the ring's.
        device: where the model is built (and computes).
    """

    weights: str = "dense"
    offload: bool = False
    host: tuple[str, ...] | None = None
    layers: int | None = None
    slots: int | None = None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, not {self.weights!r}")
        if self.offload and self.weights == "dense":
            raise ValueError("weight offload keeps compressed weights in host memory: it needs neuzip-lossless")
        object.__setattr__(self, "device", torch.device(self.device))
        if self.host is not None:
            object.__setattr__(self, "host", tuple(self.host))

    @property
    def compressed(self) -> bool:
        return self.weights != "dense"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model build, resolved: the source of its tensors, its transformers config, its dtypes,
    its attention backend and its :class:`Placement`.

    Args:
        source: a tensor source (:mod:`neutrain.nn.sources`, :class:`neutrain.nn.gguf.GGUFFile`).
        config: the transformers config the skeleton is built from (attention set from ``attention``).
        dtype: the compute dtype (floating parameters, and the compressed weights' products).
        storage_dtype: the dtype compressed weights are stored in when it differs from ``dtype``
            (bf16 storage under fp32 compute is the CPU setting); ``None``: ``dtype``.
        attention: transformers' ``attn_implementation`` name, or None to keep the config's.
        placement: dense, compressed, or compressed with offload, and the device.
        trust_remote_code: the architecture's code may come from the checkpoint folder.
        codec_options: extra arguments for ``neutrain.compress.compress`` (tests use short lanes).
    """

    source: TensorSource
    config: Any
    dtype: torch.dtype = torch.bfloat16
    storage_dtype: torch.dtype | None = None
    attention: str | None = None
    placement: Placement = dataclasses.field(default_factory=Placement)
    trust_remote_code: bool = False
    codec_options: dict | None = None

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype compressed weights hold."""
        return self.storage_dtype or self.dtype

    def replace(self, **changes) -> "ModelSpec":
        """A copy with ``changes`` (e.g. another placement for the same source).

        Example:
            >>> from neutrain.nn.sources import RandomInit
            >>> ModelSpec(RandomInit(), None).replace(placement=Placement("neuzip-lossless")).placement.weights
            'neuzip-lossless'
        """
        return dataclasses.replace(self, **changes)
