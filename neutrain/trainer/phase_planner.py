"""The planner by phase: the peak device memory of each phase of a run, predicted before anything is built.

:mod:`neutrain.trainer.planner` predicts the training step. A run has more phases than that, and any
of them can be the one that does not fit: the build, evaluation, the sample, checkpoint save, resume
and export. Each phase's estimate is a sum of named terms, each one a buffer the run really holds:

* ``model``: the weights resident on the device (compressed payloads, or dense tensors; with
  ``memory.offload_weights`` the embedding, lm_head, norms and the decoder slots only), as in the
  training step's estimate.
* ``decode_buffers``: the decode-buffer pool (:mod:`neutrain.nn.buffers`), reserved at the end of the
  build and kept for the whole run.
* ``scratch``: what a streaming phase adds to the resident model, bounded by the largest matrix
  (the vocabulary-sized embedding or lm_head for Llama models), tensor by tensor:

  - build: the matrix dense in the storage dtype (random init draws it in row blocks; a checkpoint
    tensor is read as stored) plus the encoder's int32 symbols of it (compressed weights; the
    4 bytes a weight that ``neutrain/nn/convert.py`` names: 2 GiB for a Llama-3 vocabulary matrix). The decode
    buffers are reserved once that scratch is handed back, so the build's scratch is the larger of the two.
  - save: one tensor's payload (compressed) or dense bytes on its way to the host; checksums run on
    the host copy.
  - resume: one tensor as read from the checkpoint, on the device before it is copied into the model.
  - export: one matrix decoded to dense (``hf``), plus its cast when the export dtype differs; one
    payload for a NeuZip export.
* ``activations`` / ``logits`` (eval): one evaluation micro-batch without gradients: its hidden state
  and one layer's working set, then the loss's logits block (chunked loss) or the full logits.
* ``kv_cache`` / ``activations`` / ``logits`` (generate): the sample's KV cache (prompt plus new tokens,
  every layer), the prompt's prefill working set, the last position's logits.

The training step (``train_step``) is :func:`~neutrain.trainer.planner.estimate_recipe`'s estimate.
Reserved adds the allocator's slack (the training step's own; 0.1 GiB elsewhere, since the phase
tracker hands cached blocks back when a phase starts, :mod:`neutrain.trainer.phases`); device adds
the CUDA context.

Example:
    >>> from neutrain.config import load_recipe
    >>> plan = plan_recipe(load_recipe("llama3_8b", ["export.format=hf", "eval.sample_prompt=Once upon a time"]))
    >>> list(plan)  # the recipe evaluates no held-out perplexity
    ['build', 'train_step', 'generate', 'save', 'resume', 'export']
    >>> name, worst = peak_phase(plan)
    >>> 12 < worst.reserved / GIB < 14.5
    True
"""

from __future__ import annotations

from typing import Any

from neutrain.config.schema import Recipe
from neutrain.trainer.modeling import config_only
from neutrain.trainer.planner import (
    ALLOCATOR_SLACK_BYTES, GIB, NEUZIP_BITS, Estimate, ModelShape, estimate, estimate_recipe,
)

ENCODE_SYMBOL_BYTES = 4  # int32 exponent symbols per weight while a matrix is encoded (nn/convert.py)
_EXPORT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _largest_matrix(shape: ModelShape) -> int:
    return max(r * c for _, r, c in shape.matrices())


def phase_estimates(shape: ModelShape, train: Estimate, *, eval_batch: int, prompt_tokens: int = 16,
                    sample_tokens: int = 64, dtype_bytes: int = 2, export_format: str = "hf",
                    export_bytes: int | None = None, loss_chunk_bytes: int = 256 << 20) -> dict[str, Estimate]:
    """Each phase's predicted peak, from the training step's estimate (``train``) and the model's shape.

    Args:
        shape: The model's shape.
        train: The training step's estimate (:func:`~neutrain.trainer.planner.estimate`); its settings
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
        >>> round(plan["save"].terms["scratch"] / GIB, 2), round(plan["build"].terms["scratch"] / GIB, 2)
        (0.67, 2.94)
    """
    s = train.settings
    compressed = str(s["weights"]).startswith("neuzip")
    bits = s.get("bits_per_weight", NEUZIP_BITS) if compressed else 8 * dtype_bytes
    model = train.terms["weights"] + train.terms.get("weight_slots", 0.0)
    buffers = train.terms.get("decode_buffers", 0.0)
    largest = _largest_matrix(shape)
    dense, payload = largest * dtype_bytes, largest * bits / 8
    h, kv, v = shape.hidden, shape.kv_heads * shape.head_dim, shape.vocab

    def phase(terms: dict[str, float], slack: float = ALLOCATOR_SLACK_BYTES) -> Estimate:
        return Estimate({"model": model, **terms}, dict(s), slack)

    def layer_live(tokens: int) -> float:  # one decoder layer's intermediates (planner.estimate's count)
        return tokens * (4 * h + 2 * kv + 3 * shape.intermediate) * dtype_bytes

    encode = largest * ENCODE_SYMBOL_BYTES if compressed else 0
    plan = {"build": phase({"scratch": max(dense + encode, buffers)}), "train_step": train}
    tokens = eval_batch * s["seq"]
    logits = (min(loss_chunk_bytes, tokens * v * 4) + tokens * h * 4 if s["chunked_loss"]
              else tokens * v * (dtype_bytes + 4))
    plan["eval"] = phase({"decode_buffers": buffers, "activations": tokens * h * dtype_bytes + layer_live(tokens),
                          "logits": logits})
    context = prompt_tokens + sample_tokens
    plan["generate"] = phase({"decode_buffers": buffers, "kv_cache": shape.layers * 2 * kv * context * dtype_bytes,
                              "activations": prompt_tokens * h * dtype_bytes + layer_live(prompt_tokens),
                              "logits": 2 * v * 4})  # the last position's fp32 logits and the sampling probabilities
    one_tensor = payload if compressed else dense
    plan["save"] = phase({"decode_buffers": buffers, "scratch": one_tensor})
    plan["resume"] = phase({"decode_buffers": buffers, "scratch": one_tensor})
    if export_format != "none":
        if export_format == "hf":
            cast = largest * export_bytes if export_bytes and export_bytes != dtype_bytes else 0
            scratch = dense + cast
        else:
            # Compressed weights are written as they are; dense ones are encoded matrix by matrix.
            scratch = payload if compressed else dense + largest * ENCODE_SYMBOL_BYTES
        plan["export"] = phase({"decode_buffers": buffers, "scratch": scratch})
    return plan


def plan_recipe(recipe: Recipe, train: Estimate | None = None) -> dict[str, Estimate]:
    """:func:`phase_estimates` for a recipe (its model config only: nothing is built).

    Phases the recipe does not run are left out: ``eval`` without held-out perplexity, ``generate``
    without ``eval.sample_prompt``, ``export`` with ``export.format: none``. Build, training step, save
    and resume are always there (a save may come at any ``train.save_steps``, a resume at any relaunch).
    """
    train = train or estimate_recipe(recipe)
    shape = ModelShape.from_config(config_only(recipe.model))
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
        >>> print(plan_table(plan_recipe(load_recipe("llama3_8b"))).splitlines()[0])
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
