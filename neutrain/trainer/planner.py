"""The memory planner: predict peak GPU memory of a training run before loading anything.

``neutrain estimate recipes/<x>.yaml`` reads only the model config and the
recipe. The estimate is a sum of named terms, each one a buffer the run really
allocates, so a gap between estimate and measurement points at the term that is
off (``benchmarks/train_memory.py`` reports both side by side). That sum is the
peak *allocated*; a card must hold more: :attr:`Estimate.reserved` adds the
caching allocator's slack and :attr:`Estimate.device` the CUDA context.

Terms (bytes):

* ``weights``: dense ``P x dtype``; NeuZip ``matrix params x bits/8`` plus dense norms.
* ``gradients``: a full gradient per parameter for optimizers that step after
  backward; fused updates keep only the largest single gradient alive: a decoder
  matrix's when the embedding and lm_head take theirs row block by row block
  (compressed, untied, an element-wise rule: LOMO, AdamW in backward), else the
  vocabulary-sized one of the embedding or lm_head, assembled once.
* ``optimizer_state``: AdamW two moments; AdaLomo factored row/column moments; LOMO none.
* ``optimizer_temporaries``: foreach AdamW's model-sized temporaries inside ``step()``.
* ``update_temporaries``: fused updates run in fp32 on row chunks (``chunk_numel``).
* ``weight_slots`` (``memory.offload_weights``): the decoder layers' compressed weights live in host
  memory (``settings["host_weight_bytes"]``); the GPU holds ``slots`` layers of them (default 4: the
  current layer, the one before and two fetched ahead, :mod:`neutrain.nn.weight_offload`), and
  ``weights`` counts only the embedding, lm_head and norms. ``settings`` also gives the PCIe bytes of
  a step (:func:`offload_traffic`).
* ``decode_buffers``: two layer-sized slots (prefetch) plus one slot for the
  embedding/lm_head matrix.
* ``activations``: with checkpointing, each decoder layer keeps its input
  hidden state and one layer is recomputed at a time; without it, every layer
  keeps its intermediates.
* ``logits``: the chunked loss keeps one ``tokens x chunk`` fp32 block; the
  unchunked Hugging Face loss keeps bf16 logits, their fp32 upcast and gradient.

Example:
    >>> from neutrain.config import load_recipe
    >>> from neutrain.trainer.planner import estimate_recipe
    >>> est = estimate_recipe(load_recipe("llama3_8b"))
    >>> print(est.table())  # doctest: +ELLIPSIS
    term                         GiB
    weights                    10.17
    ...
    total (peak allocated)     12.30
    reserved (predicted)       12.44
    device used (predicted)    13.19
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neutrain.config.schema import FUSED_OPTIMIZERS, Recipe
from neutrain.trainer.modeling import config_only

GIB = 2**30
NEUZIP_BITS = 10.88  # in memory (stream headroom included), Llama-3-8B shapes at N(0, 0.02); tests/unit/compress/test_codec.py
# Beyond peak allocated, fitted on an H100 and an H200 with expandable segments (neutrain's default)
# after the build's transients were handed back (benchmarks/results/train_memory.json, train_70b.json):
# reserved - allocated = 0.13 GiB (8B, 1K tokens), 1.36 (70B, 16K), 1.9 (70B, 24K): about one and a
# half of the largest activation block (tokens x intermediate) plus 0.1 GiB.
ALLOCATOR_SLACK_BLOCKS = 1.5
ALLOCATOR_SLACK_BYTES = 0.1 * 2**30
CUDA_CONTEXT_BYTES = 0.75 * 2**30  # context, cuBLAS/cuDNN workspaces and kernels: device used - reserved - idle, H100


@dataclass
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads, vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        )

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of every weight matrix; norms are not matrices."""
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
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim
        per_layer = 2 * q * h + 2 * kv * h + 3 * self.intermediate * h  # q, k, v, o; gate, up, down
        return self.layers * per_layer + self.vocab * h * (1 if self.tied else 2)

    def norm_params(self) -> int:
        return self.hidden * (2 * self.layers + 1)

    def params(self) -> int:
        return self.matrix_params() + self.norm_params()

    def largest_layer_matrix(self) -> int:
        return max(r * c for n, r, c in self.matrices() if n.startswith("layers."))


HOST_STREAM_ROOM = 0.02
"""Host bytes pinned beyond the compressed payload: each exponent stream's arena keeps 1/16 room to grow
(:mod:`neutrain.nn.weight_offload`), and the stream is about a quarter of the payload."""


def offload_traffic(shape: ModelShape, bits_per_weight: float = NEUZIP_BITS, slots: int = 4) -> dict[str, float]:
    """Host bytes and PCIe bytes per step of ``memory.offload_weights`` (weights stay compressed both ways).

    Forward fetches every layer but the ``slots`` the previous backward left on the device; backward
    (checkpoint recompute and update share one fetch) every layer but the ``slots`` forward left; each
    layer's re-encoded weights go back once.

    Example:
        >>> t = offload_traffic(ModelShape(8192, 28672, 80, 64, 8, 128256, False, 128))
        >>> round(t["host_weight_bytes"] / GIB, 1), round(t["h2d_bytes_per_step"] / GIB, 1)
        (86.7, 164.7)
    """
    layer = sum(r * c for n, r, c in shape.matrices() if n.startswith("layers.0.")) * bits_per_weight / 8
    fetched = 2 * max(0, shape.layers - slots)
    return {"layer_bytes": layer, "host_weight_bytes": shape.layers * layer,
            "host_pinned_bytes": shape.layers * layer * (1 + HOST_STREAM_ROOM),
            "h2d_bytes_per_step": fetched * layer, "d2h_bytes_per_step": shape.layers * layer}


@dataclass
class Estimate:
    """A peak-memory estimate as named terms (bytes)."""

    terms: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    slack: float = 0.0

    @property
    def total(self) -> float:
        """Peak allocated bytes: the sum of the terms."""
        return sum(self.terms.values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    @property
    def reserved(self) -> float:
        """Peak bytes the caching allocator reserves: allocated plus its slack (see ``ALLOCATOR_SLACK_*``)."""
        return self.total + self.slack

    @property
    def device(self) -> float:
        """Device memory this process uses (NVML; the card must hold it): reserved plus the CUDA context.

        A card that also shows memory used before the process starts (0.47 GiB on the H100 measured)
        needs that much more."""
        return self.reserved + CUDA_CONTEXT_BYTES

    def table(self) -> str:
        lines = [f"{'term':<22}{'GiB':>10}"]
        lines += [f"{k:<22}{v / GIB:>10.2f}" for k, v in self.terms.items()]
        lines.append(f"{'total (peak allocated)':<22}{self.total_gib:>10.2f}")
        lines.append(f"{'reserved (predicted)':<22}{self.reserved / GIB:>10.2f}")
        lines.append(f"{'device used (predicted)':<22}{self.device / GIB:>9.2f}")
        if self.settings.get("offload_weights"):  # memory.offload_weights: host memory and the link
            s = self.settings
            lines.append(f"{'host pinned (weights)':<22}{s['host_weight_bytes'] / GIB:>10.2f}")
            lines.append(f"{'PCIe in / step':<22}{s['h2d_bytes_per_step'] / GIB:>10.2f}")
            lines.append(f"{'PCIe out / step':<22}{s['d2h_bytes_per_step'] / GIB:>10.2f}")
        return "\n".join(lines)


def estimate(shape: ModelShape, *, batch: int, seq: int, weights: str = "dense", optimizer: str = "adamw",
             checkpointing: bool = True, offload_activations: bool = False, offload_weights: bool = False,
             offload_slots: int = 4, dtype_bytes: int = 2,
             chunked_loss: bool | None = None,
             bits_per_weight: float = NEUZIP_BITS, chunk_numel: int = 1 << 24, loss_chunk_bytes: int = 256 << 20) -> Estimate:
    """Predict peak allocated bytes of one training step (and reserved, device used: :class:`Estimate`).

    Args:
        shape: The model's shape.
        batch, seq: Micro-batch rows and tokens per row.
        weights: ``dense`` or ``neuzip-*``.
        optimizer: ``adamw``, ``sgd``, ``lomo``, ``adalomo`` or ``adamw-in-backward``.
        checkpointing: Activation checkpointing per decoder layer.
        offload_activations: The checkpointed layers' saved inputs live in host memory
            (:mod:`neutrain.nn.offload`): two layers' inputs stay on the GPU at once (the
            one recomputed and the one being copied back).
        offload_weights: Decoder layers' compressed weights in host memory, ``offload_slots`` of them
            on the GPU (see :func:`offload_traffic`; compressed weights only).
        dtype_bytes: Bytes per weight/activation element (bf16: 2).
        chunked_loss: Chunked lm_head + cross-entropy (default: on for compressed weights).
    """
    compressed = weights.startswith("neuzip")
    fused = optimizer in FUSED_OPTIMIZERS
    if chunked_loss is None:
        chunked_loss = compressed
    tokens = batch * seq
    h, i_, v = shape.hidden, shape.intermediate, shape.vocab
    kv = shape.kv_heads * shape.head_dim
    t: dict[str, float] = {}
    if compressed:
        # Lossy k keeps sign + k mantissa bits raw beside the ~2.65-bit entropy-coded exponent.
        bits = bits_per_weight if weights == "neuzip-lossless" else 1 + int(weights.rsplit("-", 1)[1]) + 2.65
        t["weights"] = shape.matrix_params() * bits / 8 + shape.norm_params() * dtype_bytes
        t["decode_buffers"] = (2 * shape.largest_layer_matrix() + v * h) * dtype_bytes
        if offload_weights:
            traffic = offload_traffic(shape, bits, offload_slots)
            t["weights"] -= traffic["host_weight_bytes"]
            t["weight_slots"] = min(offload_slots, shape.layers) * traffic["layer_bytes"] * (1 + 1 / 16)
    else:
        t["weights"] = shape.params() * dtype_bytes
    if fused:
        # The largest single gradient alive at once. Compressed, untied and element-wise: the embedding
        # and lm_head are updated from row blocks (a chunk_numel buffer), so a decoder matrix's gradient.
        # (AdaLomo's factored statistics need its whole gradient; the other fused rules are element-wise.)
        streamed = compressed and chunked_loss and not shape.tied and optimizer != "adalomo"
        largest = max(shape.largest_layer_matrix(), chunk_numel) if streamed else v * h
        t["gradients"] = largest * dtype_bytes
        t["update_temporaries"] = 3 * chunk_numel * 4
    else:
        t["gradients"] = shape.params() * dtype_bytes
    if optimizer in ("adamw", "adamw-in-backward"):
        t["optimizer_state"] = 2 * shape.params() * dtype_bytes
    if optimizer == "adamw":
        # torch's foreach AdamW (the CUDA default) builds model-sized temporaries in its step.
        t["optimizer_temporaries"] = shape.params() * dtype_bytes
    elif optimizer == "adalomo":
        t["optimizer_state"] = sum((r + c) * 4 for _, r, c in shape.matrices()) + shape.norm_params() * 4
    layer_live = tokens * (4 * h + 2 * kv + 3 * i_) * dtype_bytes  # q,k,v,attn,o in; gate,up,act*up
    if checkpointing:
        # Saved layer inputs plus one layer's recompute working set (fitted on an H200, see train_memory.json).
        kept = 2 if offload_activations else shape.layers
        t["activations"] = kept * tokens * h * dtype_bytes + layer_live
    else:
        t["activations"] = shape.layers * layer_live + tokens * h * dtype_bytes * 4 * shape.layers
    if chunked_loss:
        t["logits"] = min(loss_chunk_bytes, tokens * v * 4) + tokens * h * 4
    else:
        t["logits"] = tokens * v * (dtype_bytes + 4 + 4)
    settings = dict(batch=batch, seq=seq, weights=weights, optimizer=optimizer, checkpointing=checkpointing,
                    offload_activations=offload_activations and checkpointing,
                    host_activation_bytes=shape.layers * tokens * h * dtype_bytes if offload_activations and checkpointing else 0,
                    chunked_loss=chunked_loss, params=shape.params(), bits_per_weight=bits_per_weight if compressed else 8 * dtype_bytes)
    if compressed and offload_weights:
        settings.update(offload_weights=True, offload_slots=offload_slots, **traffic)
    slack = ALLOCATOR_SLACK_BLOCKS * tokens * i_ * dtype_bytes + ALLOCATOR_SLACK_BYTES
    return Estimate(t, settings, slack)


def estimate_recipe(recipe: Recipe) -> Estimate:
    """Estimate a recipe's peak GPU memory from its model config, without building the model."""
    config = config_only(recipe.model)
    m, t = recipe.memory, recipe.train
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    return estimate(
        ModelShape.from_config(config), batch=t.micro_batch_size, seq=recipe.data.sequence_len,
        weights=m.weights, optimizer=t.optimizer, checkpointing=m.gradient_checkpointing,
        offload_activations=m.offload_activations, offload_weights=m.offload_weights,
        dtype_bytes=dtype_bytes, chunked_loss=(m.loss_chunk_size > 0) or None,
    )
