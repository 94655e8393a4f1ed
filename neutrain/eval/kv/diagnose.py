"""Why a compressed cache loses accuracy: the model properties ShadowKV and MiniCache rest on, measured.

* :func:`key_spectrum`: ShadowKV stores the pre-RoPE keys of a layer (all KV heads side by side,
  ``[tokens, heads * head_dim]``) as a rank-``r`` SVD. The fraction of the squared singular values
  the first ``r`` carry (the "energy") says how much of the keys rank ``r`` keeps.
* :func:`adjacent_layer_cosine`: MiniCache merges layer ``l`` with ``l + 1`` by interpolating the
  per-token directions of their KV states. The mean cosine of those directions says how much a
  merge changes them (1: nothing lost; the paper measures > 0.9 in deep LLaMA-2 layers).
* :func:`merge_plan`: which of MiniCache's layer pairs a merge would restore within a tolerance,
  and the ``min_similarity`` that merges exactly those (chosen per model, from its own states).
* :func:`needle_chunk_recall`: ShadowKV attends only to the chunks its landmarks select. The
  fraction of the needle's chunks among the selected (or kept-exact outlier) chunks says whether
  the selection finds what the question asks for.

All take the prefill states of one prompt from :func:`prefill_states` (exact, full attention).

Example:
    >>> states = prefill_states(model, ids)  # doctest: +SKIP
    >>> key_spectrum(states["pre_rope_keys"], ranks=(8, 32))[0]  # doctest: +SKIP
    {8: 0.71, 32: 0.95}
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from transformers import DynamicCache

from neutrain import compat

from .minicache import mean_direction_cosine, per_token, slerp_merge
from .shadowkv import _find_rotary
from .shadowkv_math import invert_rope, rope_cos_sin


@torch.inference_mode()
def prefill_states(model, input_ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Keys (post-RoPE, as cached), pre-RoPE keys and values of every layer after prefilling ``input_ids``.

    Pre-RoPE keys are recovered by inverting RoPE on the cached keys, exactly as ShadowKV does before its SVD.
    Returns ``{"keys", "pre_rope_keys", "values"}``, each a list over layers of [b, h, n, d] fp32 tensors.
    """
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{compat.cache_forward_kwarg(model): cache})
    rotary = _find_rotary(model)
    n = input_ids.shape[1]
    cos, sin = rope_cos_sin(rotary, torch.arange(n, device=input_ids.device)[None], torch.float32)
    keys = [layer.keys.float() for layer in cache.layers]
    return {
        "keys": keys,
        "pre_rope_keys": [invert_rope(k, cos[:, None], sin[:, None]) for k in keys],
        "values": [layer.values.float() for layer in cache.layers],
    }


def spectrum_energy(x: torch.Tensor, ranks: Sequence[int]) -> dict[int, float]:
    """Fraction of ``||x||_F^2`` that the best rank-``r`` approximation of ``x`` [n, m] keeps, per ``r``.

    Example:
        >>> spectrum_energy(torch.outer(torch.arange(1.0, 5), torch.ones(3)), ranks=(1, 2))
        {1: 1.0, 2: 1.0}
    """
    s2 = torch.linalg.svdvals(x.double()) ** 2
    cum = torch.cumsum(s2, 0) / s2.sum().clamp_min(1e-300)
    return {r: round(float(cum[min(r, len(cum)) - 1]), 6) for r in ranks}


def key_spectrum(pre_rope_keys: list[torch.Tensor], ranks: Sequence[int] = (8, 16, 32, 64)) -> list[dict[int, float]]:
    """Per layer: energy of the pre-RoPE keys (heads side by side, batch row 0) kept at each rank."""
    out = []
    for k in pre_rope_keys:
        _, h, n, d = k.shape
        out.append(spectrum_energy(k[0].permute(1, 0, 2).reshape(n, h * d), ranks))
    return out


def adjacent_layer_cosine(states: list[torch.Tensor]) -> list[float]:
    """Mean over tokens of the cosine between layer ``l``'s and ``l + 1``'s per-token state vectors.

    Returns one value per adjacent pair (``len(states) - 1`` values); vectors are over all heads, as
    MiniCache merges them (:func:`neutrain.eval.kv.minicache.per_token`).

    Example:
        >>> x = torch.randn(1, 2, 5, 4)
        >>> adjacent_layer_cosine([x, 3 * x, -x])
        [1.0, -1.0]
    """
    return [round(mean_direction_cosine(a, b), 6) for a, b in zip(states[:-1], states[1:])]


def merge_restore_error(x_prev: torch.Tensor, x_next: torch.Tensor, t: float = 0.6) -> float:
    """Relative squared error of MiniCache's restore of a merged pair (no retained tokens), the worse layer's.

    Both layers' states ([b, h, n, d]) are merged by SLERP of their per-token directions and restored
    with their own norms; returns ``max over the two layers of ||restored - x||^2 / ||x||^2``.

    Example:
        >>> x = torch.randn(1, 2, 5, 4)
        >>> merge_restore_error(x, 2 * x) < 1e-10, round(merge_restore_error(x, -x), 3)
        (True, 4.0)
    """
    a, c = per_token(x_prev).float(), per_token(x_next).float()
    e, n_prev, n_next, _ = slerp_merge(a, c, t)
    unit = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    errors = [((unit * n[..., None] - x) ** 2).sum() / (x**2).sum().clamp_min(1e-30)
              for x, n in ((a, n_prev), (c, n_next))]
    return float(max(errors))


def tolerance_similarity(t: float = 0.6, tolerance: float = 0.1) -> float:
    """The cosine between two layers' token vectors at which MiniCache's restore loses ``tolerance`` (squared,
    relative) of the worse layer's vector.

    SLERP puts the merged direction at angle ``t * Omega`` from layer ``l - 1`` and ``(1 - t) * Omega`` from
    layer ``l``; restored with its own norm, a vector loses ``2 - 2 cos(angle)`` of its squared norm. So the
    worse side meets ``tolerance`` up to ``Omega* = arccos(1 - tolerance / 2) / max(t, 1 - t)``.

    Example:
        >>> round(tolerance_similarity(0.6, 0.1), 3), tolerance_similarity(0.5, 0.0)
        (0.863, 1.0)
    """
    omega = math.acos(max(-1.0, min(1.0, 1.0 - tolerance / 2))) / max(t, 1.0 - t)
    return math.cos(min(omega, math.pi))


def merge_plan(keys: list[torch.Tensor], values: list[torch.Tensor], start_layer: int | None = None,
               t: float = 0.6, tolerance: float = 0.1) -> dict:
    """MiniCache's pairs from ``start_layer`` (default ``L // 2``), which of them to merge, and the threshold.

    A pair merges when the restore of its merged keys and of its merged values each loses at most
    ``tolerance`` of the states' energy (:func:`merge_restore_error`). The pair's similarity is what
    ``MiniCache(min_similarity=...)`` measures at a prompt (the lower of the keys' and the values'
    mean direction cosine); ``min_similarity`` is the lowest similarity among the pairs that merge, so the
    cache merges those pairs, or, when none qualifies, :func:`tolerance_similarity` (the cosine a pair needs
    for its merge to meet the tolerance at all; near-orthogonal pairs, whose cosine is noise around 0 from
    prompt to prompt, never reach it, so the cache merges nothing on the evaluated prompts either).

    Why: how similar adjacent layers are is the model's property (SmolLM2 and the retrieval model:
    near-orthogonal everywhere, where merging lost 67-90 points), so the threshold is found per model
    from its own prefill states, not fixed.

    Example:
        >>> x = [torch.randn(1, 2, 6, 4) for _ in range(4)]
        >>> x[3] = 3 * x[2]
        >>> plan = merge_plan(x, x, start_layer=0)
        >>> plan["merged_pairs"], plan["min_similarity"]
        ([[2, 3]], 1.0)
    """
    layers = len(keys)
    start = layers // 2 if start_layer is None else start_layer
    pairs = []
    for first in range(start, layers - 1, 2):
        similarity = min(mean_direction_cosine(keys[first], keys[first + 1]),
                         mean_direction_cosine(values[first], values[first + 1]))
        error = max(merge_restore_error(keys[first], keys[first + 1], t),
                    merge_restore_error(values[first], values[first + 1], t))
        pairs.append({"layers": [first, first + 1], "similarity": round(similarity, 6),
                      "restore_error": round(error, 6), "within_tolerance": error <= tolerance})
    within = [p["similarity"] for p in pairs if p["within_tolerance"]]
    # Nothing within the tolerance: the similarity at which a merge starts to meet it (not "just above the
    # highest calibration pair": on near-orthogonal layers that is noise around 0, which other prompts cross).
    threshold = min(within) if within else round(tolerance_similarity(t, tolerance), 6)
    # what the cache does with that threshold (a pair out of tolerance but at least as similar merges too)
    return {"min_similarity": threshold, "tolerance": tolerance, "t": t, "start_layer": start, "pairs": pairs,
            "merged_pairs": [p["layers"] for p in pairs if p["similarity"] >= threshold]}


@torch.inference_mode()
def model_merge_plan(model, prompts: Sequence[torch.Tensor], **options) -> dict:
    """:func:`merge_plan` of ``model`` from the prefill states of ``prompts`` (token id tensors [1, n]), their
    tokens pooled; ``options`` as :func:`merge_plan`. The calibration prompts should not be the evaluated ones."""
    keys, values = None, None
    for ids in prompts:
        states = prefill_states(model, ids)
        keys = states["keys"] if keys is None else [torch.cat(p, dim=2) for p in zip(keys, states["keys"])]
        values = states["values"] if values is None else [torch.cat(p, dim=2) for p in zip(values, states["values"])]
    plan = merge_plan(keys, values, **options)
    plan["calibration_prompts"] = len(prompts)
    return plan


def needle_token_positions(tokenizer, prompt: str, needle: str) -> list[int]:
    """Token indices (in ``tokenizer(prompt, add_special_tokens=False)``) whose text overlaps ``needle``'s
    first occurrence in ``prompt``. Needs a fast tokenizer (offset mapping).

    Example:
        >>> from neutrain.eval.tasks import char_tokenizer
        >>> needle_token_positions(char_tokenizer(), "ab 123 cd", "123")
        [3, 4, 5]
    """
    start = prompt.find(needle)
    if start < 0:
        raise ValueError(f"needle {needle!r} not in the prompt")
    end = start + len(needle)
    offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]


def needle_chunk_recall(cache, needle_positions: Sequence[int]) -> dict[str, list[float]]:
    """Per layer: share of the needle's chunks ShadowKV attended to, over the decode steps it logged.

    ``cache`` is a :class:`~neutrain.eval.kv.ShadowKVCache` built with ``log_selection=True`` that has
    decoded at least one sparse step. Chunks in the local window are always attended and are left out;
    a layer whose needle lies wholly there gets ``nan``. ``selected`` counts the landmark selection
    alone, ``covered`` also the outlier chunks kept exactly. Averaged over KV heads, batch rows and steps.
    """
    selected, covered = [], []
    for layer in cache.layers:
        log = getattr(layer, "selection_log", [])
        if not log:
            selected.append(float("nan"))
            covered.append(float("nan"))
            continue
        cs = layer.chunk_size  # the layer's own (finer when the budget is small: min_selected_chunks)
        needle = sorted({p // cs for p in needle_positions if p < layer.context})
        if not needle:
            selected.append(float("nan"))
            covered.append(float("nan"))
            continue
        target = torch.tensor(needle, device=log[0].device)
        outlier = layer.outlier_ids  # [b, h, outliers]
        sel_hits, cov_hits = [], []
        for chunk_ids in log:  # [b, h, k]
            hit = (chunk_ids[..., None] == target).any(-2)  # [b, h, needle]
            out_hit = (outlier[..., None] == target).any(-2)
            sel_hits.append(hit.float().mean())
            cov_hits.append((hit | out_hit).float().mean())
        selected.append(round(float(torch.stack(sel_hits).mean()), 6))
        covered.append(round(float(torch.stack(cov_hits).mean()), 6))
    return {"selected": selected, "covered": covered}
