"""The planner by phase: the peak device memory of each phase of a run, predicted before anything is built.

:mod:`neutrain.memory.planner` predicts the training step. A run has more phases, and any of them can
be the one that does not fit: the build, evaluation, the sample, checkpoint save, resume and export.
Each phase's estimate is a sum of named terms, each one a buffer the run really holds:

* ``model``: the weights resident on the device (compressed payloads, or dense tensors; with
  ``memory.offload_weights`` those of the layers left on the device, the embedding, lm_head and norms),
  as in the training step's estimate, plus the weight store's slots once a step has fetched into them
  (they are allocated at the first fetch: the build and the resume, which precede training, have none).
* ``decode_buffers``: the decode-buffer pool (:mod:`neutrain.nn.buffers`): the two layer slots, reserved
  at the end of the build and pinned for the whole run, and the large slot for the embedding/lm_head
  matrix, reserved with them and, under expandable segments (neutrain's default), freed after its
  first use and allocated again only by a phase that decodes that matrix whole (the loss of evaluation,
  the sample's logits). So the build and the resume hold it, save and export do not.
* ``scratch``: what a streaming phase adds to the resident model, bounded by the largest matrix
  (the vocabulary-sized embedding or lm_head for Llama models), tensor by tensor:

  - build: the matrix dense in the storage dtype (random init draws it; a checkpoint tensor is read
    as stored) plus the GPU encoder's scratch, :data:`ENCODE_SCRATCH_BYTES` a weight (compressed
    weights). The decode buffers are reserved once that scratch is handed back, so the build's
    scratch is the larger of the two.
  - save: the checksum's device scratch (:data:`CHECKSUM_SCRATCH_BYTES`; the compressed blobs are
    written from views, one tensor copied to the host at a time), or one dense tensor.
  - resume: one tensor as read from the checkpoint, on the device before it is copied into the model.
  - export: one matrix decoded to dense (``hf``), plus its cast when the export dtype differs; the
    checksum's scratch for a NeuZip export of compressed weights (written as they are).
* ``activations`` / ``logits`` (eval): one evaluation micro-batch without gradients: its hidden state
  and one layer's working set, then the loss's logits block (chunked loss) or the full logits.
* ``kv_cache`` / ``activations`` / ``logits`` (generate): the sample's KV cache (prompt plus new tokens,
  every layer), the prompt's prefill working set, the last position's logits.

The training step (``train_step``) is :func:`~neutrain.memory.planner.estimate_recipe`'s estimate.
Reserved adds the allocator's slack (the training step's own; 0.1 GiB elsewhere, since the phase
tracker hands cached blocks back when a phase starts, :mod:`neutrain.memory.phases`); device adds
the CUDA context. ``tests/unit/memory/test_phase_planner.py`` holds every phase against the 8B's
measured peaks, in the GPU and offloaded.

Example:
    >>> from neutrain.config import load_recipe
    >>> plan = plan_recipe(load_recipe("llama3_8b", ["memory.weights=neuzip-lossless", "export.format=hf",
    ...                                              "eval.sample_prompt=Once upon a time"]))
    >>> list(plan)  # the recipe evaluates no held-out perplexity
    ['build', 'train_step', 'generate', 'save', 'resume', 'export']
    >>> name, worst = peak_phase(plan)
    >>> 11.5 < worst.reserved / GIB < 13
    True
"""

from __future__ import annotations

from typing import Any

from neutrain.config.schema import Recipe
from neutrain.memory.planner import (
    ALLOCATOR_SLACK_BYTES, GIB, NEUZIP_BITS, Estimate, estimate, estimate_recipe,
)
from neutrain.memory.shape import ModelShape, recipe_shape

ENCODE_SCRATCH_BYTES = 1.5
"""Device bytes a weight, beyond the dense matrix, that the GPU build holds while it encodes its largest
matrix. Measured, not derived: the 8B's build phase on an H200 (commit 4c4718b) peaked at 11.91 GiB allocated in the GPU
and 3.02 offloaded (benchmarks/cards/results.jsonl, cards_22_train.log and cards_11_train.log),
0.76 and 0.71 GiB above the resident model and the dense 525M-element lm_head: 1.45 to 1.55 bytes a
weight. Reading the code accounts for less (the histogram's 16M-element int64 chunks, ~0.2 GiB; the new
payload is the model's); the rest is what the card showed. It replaces the CPU reference encoder's int32
symbols (4 bytes a weight), which the Triton path never allocates."""
CHECKSUM_SCRATCH_BYTES = 96 * 2**20
"""The checksum of a device blob: 4 MiB chunks, each upcast to int64 by torch's reductions (neutrain.compress.checksum)."""
_EXPORT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS's workspace on Hopper and later (4 MiB before; counted at Hopper's size on every card), which torch takes
from the caching allocator at a stream's first product, one per stream: inside the budget's limit, so a
generation counts it. Seen on an H200: a generation at the least budget its plan allowed without this term ran
out of memory asking for 32 MiB at its first product (tests/unit/test_placement.py, the generate test in each form)."""
DECODE_STREAMS = 2
"""Streams the decode engine runs products on, each with its own workspace: the main one and the one its CUDA
graph is captured on."""


def phase_estimates(shape: ModelShape, train: Estimate, *, eval_batch: int, prompt_tokens: int = 16,
                    sample_tokens: int = 64, dtype_bytes: int = 2, export_format: str = "hf",
                    export_bytes: int | None = None, loss_chunk_bytes: int = 256 << 20) -> dict[str, Estimate]:
    """Each phase's predicted peak, from the training step's estimate (``train``) and the model's shape.

    Args:
        shape: The model's shape.
        train: The training step's estimate (:func:`~neutrain.memory.planner.estimate`); its settings
            say the weights' storage, the sequence length and whether the loss is chunked.
        eval_batch: Rows per evaluation micro-batch.
        prompt_tokens, sample_tokens: The end-of-run sample's prompt length (an upper bound is fine)
            and new tokens.
        dtype_bytes: Bytes per dense weight and activation element.
        export_format: ``hf``, ``neuzip*`` or ``none`` (then the export phase is left out).
        export_bytes: Bytes per exported dense weight (default: ``dtype_bytes``).

    Example:
        >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
        >>> train = estimate(shape, batch=1, seq=1024, weights="neuzip-lossless", optimizer="lomo")
        >>> plan = phase_estimates(shape, train, eval_batch=1)
        >>> round(plan["resume"].terms["scratch"] / GIB, 2), round(plan["build"].terms["scratch"] / GIB, 2)
        (0.67, 1.71)
    """
    s = train.settings
    compressed = str(s["weights"]).startswith("neuzip")
    bits = s.get("bits_per_weight", NEUZIP_BITS) if compressed else 8 * dtype_bytes
    before_training = train.terms["weights"]  # the store's slots come with the first fetch
    after_training = before_training + train.terms.get("weight_slots", 0.0)
    layer_slots, vocab_slot = s.get("layer_slot_bytes", 0.0), s.get("vocab_slot_bytes", 0.0)
    # Layer groups (neutrain.nn.groups) hold the vocabulary slot through training (a save between steps holds
    # it too); it is given back when training ends, before the export.
    held = layer_slots + (vocab_slot if "vocab_slot" in train.terms else 0.0)
    largest = shape.largest_matrix()
    dense, payload = largest * dtype_bytes, largest * bits / 8
    h, v = shape.hidden, shape.vocab

    def phase(model: float, terms: dict[str, float], slack: float = ALLOCATOR_SLACK_BYTES) -> Estimate:
        return Estimate({"model": model, **terms}, dict(s), slack)

    encode = largest * ENCODE_SCRATCH_BYTES if compressed else 0
    plan = {"build": phase(before_training, {"scratch": max(dense + encode, layer_slots + vocab_slot)}),
            "train_step": train}
    tokens = eval_batch * s["seq"]
    logits = (min(loss_chunk_bytes, tokens * v * 4) + tokens * h * 4 if s["chunked_loss"]
              else tokens * v * (dtype_bytes + 4))
    plan["eval"] = phase(after_training, {"decode_buffers": layer_slots + vocab_slot,
                                          "activations": tokens * h * dtype_bytes + _layer_live(shape, tokens, dtype_bytes),
                                          "logits": logits})
    plan["generate"] = phase(after_training, {"decode_buffers": layer_slots + vocab_slot,
                                              **generation_terms(shape, prompt_tokens, sample_tokens, 1, dtype_bytes)})
    plan["save"] = phase(after_training, {"decode_buffers": held,
                                          "scratch": CHECKSUM_SCRATCH_BYTES if compressed else dense})
    plan["resume"] = phase(before_training, {"decode_buffers": layer_slots + vocab_slot,
                                             "scratch": payload if compressed else dense})
    if export_format != "none":
        if export_format == "hf":
            cast = largest * export_bytes if export_bytes and export_bytes != dtype_bytes else 0
            scratch = dense + cast
        else:
            # Compressed weights are written as they are; dense ones are encoded matrix by matrix.
            scratch = CHECKSUM_SCRATCH_BYTES if compressed else dense + largest * ENCODE_SCRATCH_BYTES
        plan["export"] = phase(after_training, {"decode_buffers": layer_slots, "scratch": scratch})
    return plan


def _layer_live(shape: ModelShape, tokens: int, dtype_bytes: int) -> float:
    """One decoder layer's intermediates for ``tokens`` tokens (:func:`~neutrain.memory.planner.estimate`'s count)."""
    kv = shape.kv_heads * shape.head_dim
    return tokens * (4 * shape.hidden + 2 * kv + 3 * shape.intermediate) * dtype_bytes


def generation_terms(shape: ModelShape, prompt_tokens: int, new_tokens: int, batch: int = 1,
                     dtype_bytes: int = 2) -> dict[str, float]:
    """What a generation adds to the resident model, for ``batch`` rows: the KV cache (prompt plus new tokens,
    every layer), the prompt's prefill working set, the last position's fp32 logits and sampling probabilities,
    and cuBLAS's workspace on each stream the decode engine runs products on.

    Example:
        >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
        >>> round(generation_terms(shape, 16, 112)["kv_cache"] / 2**20)  # 128 positions x 128 KiB
        16
    """
    kv = shape.kv_heads * shape.head_dim
    return {"kv_cache": batch * shape.layers * 2 * kv * (prompt_tokens + new_tokens) * dtype_bytes,
            "activations": batch * (prompt_tokens * shape.hidden * dtype_bytes + _layer_live(shape, prompt_tokens, dtype_bytes)),
            "logits": batch * 2 * shape.vocab * 4,
            "cublas_workspaces": DECODE_STREAMS * CUBLAS_WORKSPACE_BYTES}


def generation_plan(shape: ModelShape, *, weights: str = "neuzip-lossless", streamed: int = 0, prompt_tokens: int,
                    new_tokens: int, batch: int = 1, dtype_bytes: int = 2, bits_per_weight: float = NEUZIP_BITS,
                    encoded: bool = False, extra: dict[str, float] | None = None) -> dict[str, Estimate]:
    """``neutrain generate``'s phases on a device, with ``streamed`` decoder layers in host memory (0: none).

    The resident weights, the weight store's slots and the decode buffers are the training step's terms for
    the same placement (:func:`~neutrain.memory.planner.estimate` with ``memory.offload_layers: streamed``,
    the layers spread as training spreads them), so a layer costs the same on both sides of the planner; the
    generation adds its own terms (:func:`generation_terms`) and the decode engine's fused projections.

    Args:
        weights: ``dense`` (loaded on the host and moved whole: no build phase on the device) or ``neuzip-lossless``
            (built on the device tensor by tensor: the build's scratch, as a run's).
        encoded: the source holds compressed blobs (a compressed run's checkpoint), placed as they are: the build
            encodes nothing.
        extra: more terms the generation holds (a draft model's weights).

    Example:
        >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
        >>> plan = generation_plan(shape, streamed=14, prompt_tokens=16, new_tokens=112)
        >>> round(peak_phase(plan)[1].reserved / GIB, 2)  # 18 layers resident, 2 slots for the 14 streamed
        8.49
    """
    offload = streamed > 0
    # Any optimizer: the terms taken from the step's estimate (weights, slots, decode buffers) do not depend on one.
    train = estimate(shape, batch=batch, seq=prompt_tokens + new_tokens, weights=weights, optimizer="lomo",
                     offload_weights=offload, offload_layers=streamed if offload else None, dtype_bytes=dtype_bytes,
                     bits_per_weight=bits_per_weight)
    plan = phase_estimates(shape, train, eval_batch=batch, prompt_tokens=prompt_tokens, sample_tokens=new_tokens,
                           dtype_bytes=dtype_bytes, export_format="none")
    generate = plan["generate"]
    generate.terms.update(generation_terms(shape, prompt_tokens, new_tokens, batch, dtype_bytes))
    # The engine runs each layer's Q/K/V and gate/up as one product (neutrain.decode.fused_projections): compressed
    # groups decode into one scratch matrix of the largest group; dense ones are concatenated, the largest group's
    # copy beside its members while it is made.
    h, kv, q = shape.hidden, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    generate.terms["projection_scratch"] = max((q + 2 * kv) * h, 2 * shape.intermediate * h) * dtype_bytes
    generate.terms.update(extra or {})
    if weights == "dense":
        return {"generate": generate}
    build = plan["build"]
    if encoded:  # one compressed blob read at a time, then the decode buffers reserved
        s = generate.settings
        build.terms["scratch"] = max(shape.largest_matrix() * bits_per_weight / 8,
                                     s["layer_slot_bytes"] + s["vocab_slot_bytes"])
    return {"build": build, "generate": generate}


def plan_recipe(recipe: Recipe, train: Estimate | None = None, shape: ModelShape | None = None) -> dict[str, Estimate]:
    """:func:`phase_estimates` for a recipe (its model config only: nothing is built).

    Phases the recipe does not run are left out: ``eval`` without held-out perplexity, ``generate``
    without ``eval.sample_prompt``, ``export`` with ``export.format: none``. Build, training step, save
    and resume are always there (a save may come at any ``train.save_steps``, a resume at any relaunch).
    """
    shape = shape or recipe_shape(recipe)
    train = train or estimate_recipe(recipe, shape)
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    ev, ex = recipe.eval, recipe.export
    prompt = ev.sample_prompt or ""
    plan = phase_estimates(
        shape, train, eval_batch=recipe.eval_micro_batch_size,
        prompt_tokens=len(prompt.encode("utf-8")) + 2,  # a token is at least one byte, plus BOS/EOS
        sample_tokens=ev.sample_tokens, dtype_bytes=dtype_bytes, export_format=ex.format,
        export_bytes=_EXPORT_BYTES.get(ex.dtype),
    )
    if not ev.perplexity:
        plan.pop("eval")
    if ev.sample_prompt is None:
        plan.pop("generate")
    return plan


def peak_phase(plan: dict[str, Estimate]) -> tuple[str, Estimate]:
    """The phase with the highest predicted reserved bytes (the one a budget must hold)."""
    name = max(plan, key=lambda k: plan[k].reserved)
    return name, plan[name]


def predicted_gib(plan: dict[str, Estimate]) -> dict[str, dict[str, float]]:
    """``{phase: {allocated_gib, reserved_gib, device_gib}}``, for summaries and the OOM message."""
    return {k: {"allocated_gib": e.total / GIB, "reserved_gib": e.reserved / GIB, "device_gib": e.device / GIB}
            for k, e in plan.items()}


def plan_table(plan: dict[str, Estimate]) -> str:
    """The predicted peaks by phase, in GiB, and the terms that make each one.

    Example:
        >>> from neutrain.config import load_recipe
        >>> print(plan_table(plan_recipe(load_recipe("llama3_8b", ["memory.weights=dense"]))).splitlines()[0])
        phase        allocated  reserved    device  terms (GiB)
    """
    lines = [f"{'phase':<12}{'allocated':>10}{'reserved':>10}{'device':>10}  terms (GiB)"]
    for name, e in plan.items():
        terms = ", ".join(f"{k} {v / GIB:.2f}" for k, v in e.terms.items() if v)
        lines.append(f"{name:<12}{e.total / GIB:>10.2f}{e.reserved / GIB:>10.2f}{e.device / GIB:>10.2f}  {terms}")
    return "\n".join(lines)


def describe(plan: dict[str, Estimate]) -> dict[str, Any]:
    """The peak phase and its figures, as the automatic fit and ``neutrain estimate`` report them."""
    name, worst = peak_phase(plan)
    return {"peak_phase": name, "reserved_gib": worst.reserved / GIB, "device_gib": worst.device / GIB}
