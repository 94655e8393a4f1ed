"""The numbers of a model that its memory depends on, read from the description the build uses.

Why from the build: the planner once counted Llama's seven matrices a layer and nothing else, while the
build makes every architecture transformers has a causal LM for: MoE expert stacks, biases, extra norms,
MLA's low-rank projections, a first dense layer before the experts. A Mixtral was counted with one MLP a
layer instead of eight, and its budget fitted to a model an eighth of the size. Given a transformers
config, :meth:`ModelShape.from_config` reads every parameter's shape from the skeleton the build itself
makes (:func:`neutrain.nn.load.parameter_shapes`, on the meta device: no memory, no weights), so each
term that counts weights counts what the build allocates (``tests/unit/memory/test_model_bytes.py`` holds
the two equal, architecture by architecture).

A recipe whose ``model.config`` mapping holds every number (:func:`~neutrain.config.model_config.plain_shape_config`:
Llama, Mistral and Qwen2 shapes) is counted in closed form instead, without importing torch or
transformers (``neutrain estimate`` stays fast); those architectures are exactly the seven matrices, two
norms a layer (and Qwen2's q/k/v biases), so both ways give the same bytes.

The activation terms still read the dense numbers (``hidden``, ``intermediate``, the heads).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

from neutrain.errors import UserInputError
from neutrain.memory.model_config import shape_config

Table = tuple[tuple[str, tuple[int, ...], int], ...]
"""``(name, shape, bytes per element at bf16 compute)`` of parameters, as the build makes them."""

BUILT_LAYERS = 128
"""Decoder layers the skeleton is built with at most: a config deeper than this (the preflight's size check
sees configs of a million layers) is counted as its first layers and the last of them repeated."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


@dataclass
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on.

    ``outside`` and ``per_layer`` (from :meth:`from_config` given a transformers config) are the parameters
    the build makes, as ``(name, shape)``: those outside the decoder layers, and each decoder layer's (the
    first :data:`BUILT_LAYERS`; a deeper model repeats the last). Without them the counts are Llama's closed
    form of the eight numbers.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: int
    # How the counts are read, not what they are: two shapes of one model compare equal however read.
    qkv_bias: bool = field(default=False, compare=False)
    outside: Table | None = field(default=None, repr=False, compare=False)
    per_layer: tuple[Table, ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: Any, trust_remote_code: bool = False) -> "ModelShape":
        heads, hidden = config.num_attention_heads, config.hidden_size
        # A config without ``intermediate_size`` (GPT-2's ``n_inner``) names its MLP width as such configs do,
        # by default four times the hidden size.
        intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                        or getattr(config, "ffn_dim", None) or 4 * hidden)
        shape = cls(
            hidden=hidden, intermediate=intermediate, layers=config.num_hidden_layers,
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads, vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
            qkv_bias=bool(getattr(config, "qkv_bias", False)),
        )
        if not callable(getattr(config, "to_dict", None)):
            return shape  # the recipe's own numbers (no transformers config): the closed form
        table = _built_table(config, trust_remote_code)
        if table is None:
            return shape
        outside, per_layer = _split(table)
        shape.outside, shape.per_layer = outside, per_layer
        return shape

    # --- the counts: from the build's table where there is one, else Llama's closed form ---

    def _layer(self, index: int) -> Table:
        return self.per_layer[min(index, len(self.per_layer) - 1)]

    def _total(self, select) -> int:
        """Elements of the parameters ``select(shape, element bytes)`` takes, over the whole model."""
        def elements(table: Table) -> int:
            return sum(math.prod(s) for _, s, size in table if select(s, size))

        sums = [elements(layer) for layer in self.per_layer]
        return elements(self.outside) + sum(sums) + ((self.layers - len(sums)) * sums[-1] if sums else 0)

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of every weight matrix; norms and biases are not matrices. An expert stack
        (experts x rows x cols, compressed and updated whole) is one matrix of experts x rows rows."""
        if self.per_layer is not None:
            def rows(table: Table, prefix: str = ""):
                return [(prefix + n, math.prod(s[:-1]), s[-1]) for n, s, _ in table if len(s) >= 2]

            mats = rows(self.outside)
            for i in range(self.layers):
                mats += rows(self._layer(i), f"layers.{i}.")
            return mats
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        layer = [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
                 ("gate_proj", self.intermediate, h), ("up_proj", self.intermediate, h), ("down_proj", h, self.intermediate)]
        mats = [("embed_tokens", self.vocab, h)]
        for i in range(self.layers):
            mats += [(f"layers.{i}.{n}", r, c) for n, r, c in layer]
        if not self.tied:
            mats.append(("lm_head", self.vocab, h))
        return mats

    def matrix_params(self) -> int:
        """:meth:`matrices`' total in closed form: the preflight size check runs it on configs of a million
        layers, where building the per-layer list took seconds."""
        if self.per_layer is not None:
            return self._total(lambda s, _: len(s) >= 2)
        return self.layers * self.layer_matrix_params() + self.vocab * self.hidden * (1 if self.tied else 2)

    def norm_params(self) -> int:
        """Elements of the vectors (norms, biases): kept dense when the matrices are compressed."""
        if self.per_layer is not None:
            return self._total(lambda s, _: len(s) < 2)
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.hidden * (2 * self.layers + 1) + bias * self.layers

    def params(self) -> int:
        return self.matrix_params() + self.norm_params()

    def fp32_params(self) -> int:
        """Elements the build keeps in fp32 whatever the compute dtype (a router some architectures pin)."""
        return self._total(lambda _, size: size == 4) if self.per_layer is not None else 0

    def largest_layer_matrix(self) -> int:
        """The largest matrix (or expert stack) of a decoder layer: what one decode slot holds."""
        if self.per_layer is not None:
            return max(math.prod(s) for layer in self.per_layer for _, s, _ in layer if len(s) >= 2)
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim
        return max(q * h, kv * h, self.intermediate * h)

    def largest_matrix(self) -> int:
        """The largest matrix of the model (the vocabulary matrices for Llama models)."""
        outside = [math.prod(s) for _, s, _ in (self.outside or ()) if len(s) >= 2]
        return max([self.largest_layer_matrix(), self.vocab * self.hidden, *outside])

    def layer_matrix_params(self) -> int:
        """One decoder layer's matrices together (what a layer group decodes at once, :mod:`neutrain.nn.groups`;
        what a streamed layer moves): the largest layer's, where layers differ (a first dense layer before
        the experts)."""
        if self.per_layer is not None:
            return max(sum(math.prod(s) for _, s, _ in layer if len(s) >= 2) for layer in self.per_layer)
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim
        return 2 * q * h + 2 * kv * h + 3 * self.intermediate * h  # q, k, v, o; gate, up, down


def recipe_shape(recipe) -> ModelShape:
    """The shape of the model a recipe's ``model`` section describes, read without building it."""
    return ModelShape.from_config(shape_config(recipe.model), bool(recipe.model.trust_remote_code))


def _built_table(config: Any, trust_remote_code: bool) -> Table | None:
    """The build's parameter table of ``config`` (at most :data:`BUILT_LAYERS` decoder layers), or None where
    the skeleton cannot be built here (remote code, an architecture transformers lacks): the closed form then."""
    from neutrain.nn.load import parameter_shapes  # lazy: torch and transformers, which a plain estimate never needs

    built = config
    if config.num_hidden_layers > BUILT_LAYERS:
        built = copy.deepcopy(config)
        built.num_hidden_layers = BUILT_LAYERS
        if isinstance(getattr(built, "layer_types", None), list):
            built.layer_types = built.layer_types[:BUILT_LAYERS]
    try:
        return tuple(parameter_shapes(built, trust_remote_code))
    except UserInputError:  # values the architecture's own code refuses: the build would refuse them the same way
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ImportError, OSError, RuntimeError):
        return None


def _split(table: Table) -> tuple[Table, tuple[Table, ...]]:
    """The table as (outside the decoder layers, each layer's own), names without the ``model.`` prefix."""
    outside: list[tuple[str, tuple[int, ...], int]] = []
    layers: dict[int, list[tuple[str, tuple[int, ...], int]]] = {}
    for name, shape, size in table:
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append((match.group(2), shape, size))
        else:
            outside.append((name.removeprefix("model."), shape, size))
    return tuple(outside), tuple(tuple(layers[i]) for i in sorted(layers))
