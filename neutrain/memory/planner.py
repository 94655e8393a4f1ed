"""The memory planner: predict peak GPU memory of a training run before loading anything.

``neutrain estimate recipes/<x>.yaml`` reads only the model config and the
recipe. The estimate is a sum of named terms, each one a buffer the run really
allocates, so a gap between estimate and measurement points at the term that is
off (``benchmarks/memory/train_memory.py`` reports both side by side). That sum is the
peak *allocated*; a card must hold more: :attr:`Estimate.reserved` adds the
caching allocator's slack and :attr:`Estimate.device` the CUDA context.

A step's peak is one moment, so the terms are what is held for the whole step plus what the
busiest moment adds. Held for the whole step (bytes):

* ``weights``: dense ``P x dtype``; NeuZip ``matrix params x bits/8`` plus dense norms.
* ``weight_slots`` (``memory.offload_weights``): ``memory.offload_layers`` decoder layers' compressed
  weights live in host memory (``settings["host_weight_bytes"]``, every layer by default) and
  ``weights`` counts only the rest; the GPU holds ``slots`` of them at once
  (:class:`~neutrain.config.layer_placement.LayerPlacement`: four when nearly every layer is offloaded,
  two when the offloaded layers are spread between resident ones). ``settings`` also gives the PCIe
  bytes of a step (:func:`offload_traffic`).
* ``decode_buffers``: the two layer-sized decode slots (prefetch), pinned for the whole run, for layers that
  decode one matrix at a time. Where a decoder layer fits in the vocabulary matrix's slot and no layer lives in
  host memory, the layers are decoded as groups into that slot's memory (:mod:`neutrain.nn.groups`): then
  ``vocab_slot`` is held for the whole step instead, and the loss adds no ``vocab_decode``.
* ``gradients`` (optimizers that step after backward) and ``optimizer_state``: AdamW two moments in the
  weights' dtype; a fused optimizer what its spec says (:class:`~neutrain.optim.registry.StateCost`:
  AdamW in backward two fp32 moments, AdaLomo factored row/column moments, LOMO none);
  ``optimizer_temporaries``: foreach AdamW's model-sized temporaries inside ``step()``.
* ``update_temporaries``: fused updates run in fp32 on row chunks (``chunk_numel``).
* ``activations``: with checkpointing, each decoder layer's saved input (with ``memory.offload_activations``
  two layers', plus those of the layers the fit keeps on the GPU, ``activation_device_layers``); without it,
  every layer's intermediates. The offloaded inputs are host bytes (``settings["host_activation_bytes"]``),
  or file bytes for the layers spilled to a file (``settings["file_activation_bytes"]``, through a pinned
  staging buffer, ``settings["activation_staging_bytes"]``: :mod:`neutrain.memory.tiers`).

The busiest moment (``settings["peak_moment"]``; both are in ``settings["moments"]``) is the larger of two:

* ``loss``: ``vocab_decode``, the embedding/lm_head matrix decoded whole into the large decode slot
  (compressed weights; under expandable segments, neutrain's default, the slot is freed after each use,
  so the decoder layers never see it), ``logits`` (the chunked loss keeps one ``tokens x chunk`` fp32
  block; the unchunked Hugging Face loss keeps bf16 logits, their fp32 upcast and gradient) and the
  vocabulary matrix's ``gradients`` for a fused update (row blocks for compressed, untied weights and an
  element-wise rule, LOMO or AdamW in backward; else the whole matrix);
* ``layer backward``: ``recompute``, one decoder layer's forward intermediates (rebuilt by the
  checkpoint; kept anyway without checkpointing) plus the MLP's backward, three ``tokens x
  intermediate`` gradients at once, and the layer's largest weight ``gradients`` for a fused update.

Example:
    >>> from neutrain.config import load_recipe
    >>> from neutrain.memory.planner import estimate_recipe
    >>> est = estimate_recipe(load_recipe("llama3_8b", ["memory.weights=neuzip-lossless"]))
    >>> print(est.table())  # doctest: +ELLIPSIS
    term                         GiB
    weights                    10.17
    ...
    total (peak allocated)     11.90
    reserved (predicted)       12.04
    device used (predicted)    12.79
    peak moment           layer backward
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neutrain.config.layer_placement import LayerPlacement
from neutrain.config.schema import FUSED_OPTIMIZERS, Recipe
from neutrain.errors import RecipeError
from neutrain.optim.registry import optimizer_spec
from neutrain.memory.shape import ModelShape, recipe_shape

GIB = 2**30
NEUZIP_BITS = 10.88  # in memory (stream headroom included), Llama-3-8B shapes at N(0, 0.02); tests/unit/compress/test_codec.py
# Beyond peak allocated, fitted on an H100 and an H200 with expandable segments (neutrain's default)
# after the build's transients were handed back (benchmarks/memory/results.jsonl#train_memory, train_70b.json):
# reserved - allocated = 0.13 GiB (8B, 1K tokens), 1.36 (70B, 16K), 1.9 (70B, 24K): about one and a
# half of the largest activation block (tokens x intermediate) plus 0.1 GiB.
ALLOCATOR_SLACK_BLOCKS = 1.5
ALLOCATOR_SLACK_BYTES = 0.1 * 2**30
CUDA_CONTEXT_BYTES = 0.75 * 2**30  # context, cuBLAS/cuDNN workspaces and kernels: device used - reserved - idle, H100


ACTIVATION_STAGING_BYTES = 64 << 20
"""Pinned host bytes through which layer inputs spilled to a file are written and read back
(:mod:`neutrain.nn.activation_file`): the copy over PCIe needs pinned memory, the file does not."""

HOST_STREAM_ROOM = 0.02
"""Host bytes pinned beyond the compressed payload: each exponent stream's arena keeps 1/16 room to grow
(:mod:`neutrain.nn.weight_offload`), and the stream is about a quarter of the payload."""


def offload_traffic(shape: ModelShape, bits_per_weight: float = NEUZIP_BITS, slots: int = 4,
                    offloaded: int | None = None) -> dict[str, float]:
    """Host bytes and PCIe bytes per step of ``memory.offload_weights`` (weights stay compressed both ways).

    ``offloaded`` of the decoder layers (``memory.offload_layers``; None: all) live in host memory.
    Forward fetches every one of them but the ``slots`` the previous backward left on the device;
    backward (checkpoint recompute and update share one fetch) every one but the ``slots`` forward
    left; each one's re-encoded weights go back once.

    Example:
        >>> t = offload_traffic(ModelShape(8192, 28672, 80, 64, 8, 128256, False, 128))
        >>> round(t["host_weight_bytes"] / GIB, 1), round(t["h2d_bytes_per_step"] / GIB, 1)
        (86.7, 164.7)
        >>> t = offload_traffic(ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128), slots=2, offloaded=8)
        >>> round(t["h2d_bytes_per_step"] / t["layer_bytes"]), round(t["d2h_bytes_per_step"] / t["layer_bytes"])
        (12, 8)
    """
    layer = shape.layer_matrix_params() * bits_per_weight / 8
    count = shape.layers if offloaded is None else offloaded
    fetched = 2 * max(0, count - slots)
    return {"layer_bytes": layer, "offloaded_layers": count, "host_weight_bytes": count * layer,
            "host_pinned_bytes": count * layer * (1 + HOST_STREAM_ROOM),
            "h2d_bytes_per_step": fetched * layer, "d2h_bytes_per_step": count * layer}


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
        s = self.settings
        if s.get("peak_moment"):
            lines.append(f"{'peak moment':<22}{s['peak_moment']}")
        if s.get("offload_weights"):  # memory.offload_weights: host memory and the link
            lines.append(f"{'layers in host memory':<22}{s['offloaded_layers']:>7} of {s['layers']}")
            lines.append(f"{'host pinned (weights)':<22}{s['host_weight_bytes'] / GIB:>10.2f}")
            lines.append(f"{'PCIe in / step':<22}{s['h2d_bytes_per_step'] / GIB:>10.2f}")
            lines.append(f"{'PCIe out / step':<22}{s['d2h_bytes_per_step'] / GIB:>10.2f}")
        return "\n".join(lines)


MLP_BACKWARD_BLOCKS = 3
"""``tokens x intermediate`` gradients the MLP's backward holds at once beside its saved intermediates: of
``act * up`` (from down_proj), of ``up`` and of the activation (then of ``gate``, as that one is freed)."""


def estimate(shape: ModelShape, *, batch: int, seq: int, weights: str = "dense", optimizer: str = "adamw",
             checkpointing: bool = True, offload_activations: bool = False, offload_weights: bool = False,
             offload_layers: int | None = None, offload_slots: int | None = None, dtype_bytes: int = 2,
             chunked_loss: bool | None = None, activation_device_layers: int = 0, activation_file_layers: int = 0,
             mlp_chunk_tokens: int = 0,
             bits_per_weight: float = NEUZIP_BITS, chunk_numel: int = 1 << 24, loss_chunk_bytes: int = 256 << 20) -> Estimate:
    """Predict peak allocated bytes of one training step (and reserved, device used: :class:`Estimate`).

    Args:
        shape: The model's shape.
        batch, seq: Micro-batch rows and tokens per row.
        weights: ``dense`` or ``neuzip-*``.
        optimizer: ``adamw``, ``sgd``, or a fused optimizer (``lomo``, ``adalomo``, ``adamw-in-backward``, any
            registered: its state's bytes and whether its update is element-wise come from its spec).
        checkpointing: Activation checkpointing per decoder layer.
        offload_activations: The checkpointed layers' saved inputs live in host memory
            (:mod:`neutrain.nn.offload`): two layers' inputs stay on the GPU at once (the
            one recomputed and the one being copied back).
        activation_device_layers, activation_file_layers: of the offloaded inputs, those of this many
            layers stay on the GPU, and of this many go on to a file (:mod:`neutrain.memory.tiers`).
        offload_weights: Decoder layers' compressed weights in host memory (compressed weights only):
            ``offload_layers`` of them (None: all), spread as
            :meth:`~neutrain.config.layer_placement.LayerPlacement.spread` spreads them, through its ring
            of slots (``offload_slots`` overrides it; see :func:`offload_traffic`).
        dtype_bytes: Bytes per weight/activation element (bf16: 2).
        chunked_loss: Chunked lm_head + cross-entropy (default: on for compressed weights).
        mlp_chunk_tokens: Tokens the gated MLP computes at once (:mod:`neutrain.nn.chunked_mlp`; 0: all): its
            ``tokens x intermediate`` intermediates and their gradients are one chunk's, and its three weight
            gradients exist at once (each handed to the update after the last chunk; two under NeuZip weights
            and a fused update, whose backward hands down's over before gate's and up's are summed).

    Example:
        >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
        >>> full = estimate(shape, batch=1, seq=1024, weights="neuzip-lossless", optimizer="lomo")
        >>> part = estimate(shape, batch=1, seq=1024, weights="neuzip-lossless", optimizer="lomo",
        ...                 offload_weights=True, offload_layers=8)
        >>> # 8 layers less 2 slots; the layers left decode one matrix at a time (no layer groups with layers in host
        >>> # memory): two layer slots again instead of the held vocabulary slot
        >>> round((full.total - part.total) / GIB, 2), part.settings["offload_slots"]
        (1.42, 2)
    """
    compressed = weights.startswith("neuzip")
    fused = optimizer in FUSED_OPTIMIZERS
    spec = optimizer_spec(optimizer) if fused else None  # its state and whether its update is element-wise
    if chunked_loss is None:
        chunked_loss = compressed
    tokens = batch * seq
    h, i_, v = shape.hidden, shape.intermediate, shape.vocab
    kv = shape.kv_heads * shape.head_dim
    t: dict[str, float] = {}
    offloading = compressed and offload_weights
    if compressed:
        # Lossy k keeps sign + k mantissa bits raw beside the ~2.65-bit entropy-coded exponent.
        bits = bits_per_weight if weights == "neuzip-lossless" else 1 + int(weights.rsplit("-", 1)[1]) + 2.65
        t["weights"] = shape.matrix_params() * bits / 8 + shape.norm_params() * dtype_bytes
        if offloading:
            placement = LayerPlacement.spread(shape.layers, offload_layers, offload_slots)
            slots = placement.slots
            traffic = offload_traffic(shape, bits, slots, placement.count)
            t["weights"] -= traffic["host_weight_bytes"]
            t["weight_slots"] = min(slots, placement.count) * traffic["layer_bytes"] * (1 + 1 / 16)
        t["decode_buffers"] = 2 * shape.largest_layer_matrix() * dtype_bytes
        if not offloading and shape.layer_matrix_params() <= v * h:
            # Layers decode as groups into the vocabulary matrix's slot, held all step (neutrain.nn.groups).
            t["vocab_slot"] = v * h * dtype_bytes
            t["decode_buffers"] = 0.0
    else:
        # Tensors the architecture keeps in fp32 (a router) take 4 bytes under bf16 weights.
        t["weights"] = shape.params() * dtype_bytes + shape.fp32_params() * max(0, 4 - dtype_bytes)
    if not fused:
        t["gradients"] = shape.params() * dtype_bytes
    if optimizer == "adamw":
        # torch's AdamW keeps two moments in the weights' dtype; its foreach step (the CUDA default) builds
        # model-sized temporaries.
        t["optimizer_state"] = 2 * shape.params() * dtype_bytes
        t["optimizer_temporaries"] = shape.params() * dtype_bytes
    if fused:
        state = spec.state.bytes(shape.params(), ((r, c) for _, r, c in shape.matrices()), shape.norm_params())
        if state:
            t["optimizer_state"] = state
        t["update_temporaries"] = 3 * chunk_numel * 4
    chunk = mlp_chunk_tokens if 0 < mlp_chunk_tokens < tokens else 0
    mlp_tokens = chunk or tokens  # rows of the MLP's intermediates at once
    attention_live = tokens * (4 * h + 2 * kv) * dtype_bytes  # q,k,v,attn,o in
    layer_live = attention_live + 3 * mlp_tokens * i_ * dtype_bytes  # gate,up,act*up
    if checkpointing:
        # Each layer's saved input (fitted on an H200, see train_memory.json); the recompute is the moment's.
        kept = min(shape.layers, 2 + activation_device_layers) if offload_activations else shape.layers
        t["activations"] = kept * tokens * h * dtype_bytes
    else:
        # A chunked MLP saves its input alone (counted in the attention's) and rebuilds the rest in its backward.
        saved = attention_live if chunk else layer_live
        t["activations"] = shape.layers * saved + tokens * h * dtype_bytes * 4 * shape.layers

    # The loss: the vocabulary matrix decoded whole, the logits block and, for a fused update, the vocabulary
    # matrix's gradient: row blocks of chunk_numel when compressed, untied and element-wise (AdaLomo's
    # factored statistics need its whole gradient), else whole.
    loss: dict[str, float] = {}
    if compressed and "vocab_slot" not in t:
        loss["vocab_decode"] = v * h * dtype_bytes
    if chunked_loss:
        loss["logits"] = min(loss_chunk_bytes, tokens * v * 4) + tokens * h * 4
    else:
        loss["logits"] = tokens * v * (dtype_bytes + 4 + 4)
    if fused:
        streamed = compressed and chunked_loss and not shape.tied and spec.elementwise
        loss["gradients"] = (chunk_numel if streamed else v * h) * dtype_bytes
    # A decoder layer's backward: its intermediates (rebuilt by the checkpoint) and the MLP's gradients.
    rebuilt = layer_live if checkpointing else 3 * chunk * i_ * dtype_bytes
    backward = {"recompute": rebuilt + MLP_BACKWARD_BLOCKS * mlp_tokens * i_ * dtype_bytes}
    if chunk:
        # The chunked MLP's own backward holds its input, the output's gradient and the input's gradient whole
        # (tokens x hidden each) beside the chunks: the unchunked fit's intermediates hid them, a chunk does not
        # (the 70B at 16K under 11 GiB ran out 0.7 GiB above the estimate without this term).
        backward["mlp_rows"] = 3 * tokens * h * dtype_bytes
        # The layer's two RMSNorms save the fp32 copy of their input for their backward (tokens x hidden x 4 bytes
        # each), alive through the MLP's backward. Unchunked, the slack fitted on the tokens x intermediate blocks
        # covers them; chunked it does not: the 70B at 16K under 11 GiB ran out of memory asking for one of these
        # 512 MiB blocks at 10.69 GiB allocated, where the estimate without them was 9.82.
        backward["norm_inputs"] = 2 * tokens * h * 4
        # Fitted, not explained: with the norms counted, the same 70B step under 12 GiB still peaked 0.82 GiB above
        # the estimate (11.64 allocated against 10.82; the norms' fp32 recompute temporaries and the rotary
        # embedding's products are the candidates). Two more fp32 row blocks keep the estimate above the measure.
        backward["row_temporaries"] = 2 * tokens * h * 4
        if compressed and "vocab_slot" not in t:
            # Gate, up and down decoded at once: the third in a held slot of its own (neutrain.nn.buffers).
            t["decode_buffers"] += shape.largest_layer_matrix() * dtype_bytes
    # Chunked over NeuZip weights in shared slots, down's gradient goes to its update before gate's and up's are
    # summed (a second pass over the chunks), so two of the three exist at once (neutrain.nn.chunked_mlp).
    two_pass = bool(chunk) and compressed and fused and "vocab_slot" not in t
    if fused or chunk:
        # Chunked, the MLP's weight gradients sum over the chunks before any goes to its update.
        largest = shape.largest_layer_matrix()
        backward["gradients"] = max(largest, (2 if two_pass else 3) * h * i_ if chunk else 0) * dtype_bytes
    moment, peak = max((("loss", loss), ("layer backward", backward)), key=lambda m: sum(m[1].values()))
    t.update(peak)
    offloaded_inputs = offload_activations and checkpointing
    device_inputs = min(activation_device_layers, shape.layers) if offloaded_inputs else 0
    file_inputs = min(activation_file_layers, shape.layers - device_inputs) if offloaded_inputs else 0
    layer_input = tokens * h * dtype_bytes
    settings = dict(batch=batch, seq=seq, weights=weights, optimizer=optimizer, checkpointing=checkpointing,
                    offload_activations=offloaded_inputs, layer_input_bytes=layer_input,
                    host_activation_bytes=(shape.layers - device_inputs - file_inputs) * layer_input if offloaded_inputs else 0,
                    activation_device_layers=device_inputs, activation_file_layers=file_inputs,
                    file_activation_bytes=file_inputs * layer_input,
                    activation_staging_bytes=ACTIVATION_STAGING_BYTES if file_inputs else 0,
                    chunked_loss=chunked_loss, mlp_chunk_tokens=chunk, mlp_two_pass=two_pass,
                    params=shape.params(), bits_per_weight=bits_per_weight if compressed else 8 * dtype_bytes,
                    layers=shape.layers, peak_moment=moment, moments={"loss": loss, "layer backward": backward},
                    layer_slot_bytes=t.get("decode_buffers", 0.0),
                    vocab_slot_bytes=t.get("vocab_slot", loss.get("vocab_decode", 0.0)))
    if offloading:
        settings.update(offload_weights=True, offload_slots=slots, offloaded=placement.offloaded, **traffic)
    # The largest activation block: tokens x intermediate, or with a chunked MLP a chunk's, or tokens x hidden
    # (the slack was fitted unchunked; for chunked runs the same one and a half blocks is assumed).
    block = max(chunk * i_, tokens * h) if chunk else tokens * i_
    slack = ALLOCATOR_SLACK_BLOCKS * block * dtype_bytes + ALLOCATOR_SLACK_BYTES
    return Estimate(t, settings, slack)


def estimate_recipe(recipe: Recipe, shape: ModelShape | None = None, activation_device_layers: int = 0,
                    activation_file_layers: int = 0) -> Estimate:
    """Estimate a recipe's peak GPU memory from its model config, without building the model.

    ``shape``: the model's, when the caller has it (else read from the recipe's model config).
    ``activation_device_layers``, ``activation_file_layers``: the fit's split of the offloaded layer inputs
    (:mod:`neutrain.memory.tiers`; no recipe key: the fit decides it from the budget and the host).

    Raises:
        RecipeError: ``memory.offload_layers`` is more than the model's decoder layers.
        ValueError: ``memory.weights: auto``, which the fit resolves first (:mod:`neutrain.memory.fit`):
            the memory depends on what it resolves to.
    """
    m, t = recipe.memory, recipe.train
    if m.weights == "auto":
        raise ValueError("memory.weights: auto is resolved by the fit (neutrain.memory.fit) before the planner runs")
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    shape = shape or recipe_shape(recipe)
    if m.offload_weights and m.offload_layers is not None and m.offload_layers > shape.layers:
        raise RecipeError(f"memory.offload_layers: {m.offload_layers} is more than the model's {shape.layers} "
                          "decoder layers")
    return estimate(
        shape, batch=t.micro_batch_size, seq=recipe.data.sequence_len,
        weights=m.weights, optimizer=t.optimizer, checkpointing=m.gradient_checkpointing,
        offload_activations=m.offload_activations, offload_weights=m.offload_weights,
        offload_layers=m.offload_layers, offload_slots=m.offload_slots, dtype_bytes=dtype_bytes,
        chunked_loss=(m.loss_chunk_size > 0) or None, mlp_chunk_tokens=mlp_chunk_tokens(recipe),
        activation_device_layers=activation_device_layers, activation_file_layers=activation_file_layers,
    )


def mlp_chunk_tokens(recipe: Recipe) -> int:
    """The recipe's ``memory.mlp_chunk_tokens`` as tokens (0: unchunked; ``auto`` the fit has left is unchunked)."""
    value = recipe.memory.mlp_chunk_tokens
    return 0 if value == "auto" else int(value)
