"""``fused_update``: LOMO's whole per-weight update in one Triton kernel.

The eager update (:mod:`neutrain.optim.rule`, :class:`neutrain.optim.LOMO`) runs, per
row chunk, an fp32 copy of the weight, the clip scaling, the decay, the step,
stochastic rounding (random integers, an add, a shift, a narrowing), a finiteness
test and a masked write-back: about a dozen kernels and four chunk-sized fp32/int32
temporaries. On an H100 training Llama-3-8B at batch 8 those small launches took
about 350 ms of a 1.29 s step (``benchmarks/memory/NOTES.md``). Here one
kernel reads the weight and the gradient once and writes the weight once.

Per element, in fp32 (``w`` bf16 or fp32, ``g`` any float, ``coef`` the optional clip
coefficient, ``ok`` the tensor's finiteness flag; both 0-dim device tensors, read in
the kernel, so nothing is read back to the host)::

    p = w * (1 - lr * wd)            # only when wd != 0
    p = fma(g * coef, -lr, p)        # coef only when clipping
    new = round_to_bf16(p)           # stochastic (Philox noise) or nearest-even
    w = new if ok and isfinite(new) else w

The reference is the eager path itself: with stochastic rounding off the kernel
equals it bit for bit (tested on a GPU). With stochastic rounding on, the noise is
Philox (``tl.randint``) keyed by a per-update seed and the element's index in the
whole tensor, so a chunked call (the streamed lm_head/embedding update) rounds
exactly as one call over the tensor, dense and compressed training round alike,
and a resumed run repeats itself; it is a different random stream from the eager
path's ``torch.Generator`` (tests check it is unbiased and deterministic).

With ``count=`` (a compressed weight about to be re-encoded) the kernel also does the
encode's first pass on the values it stores: each one's code length is added to its
lane's bit count (:func:`neutrain.kernels.codec._add_lane_bits`), so the re-encode reads
the weight once (:mod:`neutrain.compress.counted`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from neutrain.kernels import interpreting
from neutrain.kernels.codec import _add_lane_bits
from neutrain.kernels.launch import Launcher

BLOCK = 1024 if not interpreting() else 64
# No contraction of separate multiplies and adds into FMAs: the eager path rounds each op.
_NO_FUSION = {} if interpreting() else {"enable_fp_fusion": False}


@triton.jit
def _fused_update_kernel(w_ptr, g_ptr, coef_ptr, ok_ptr, n, base, neg_lr, decay, seed, enc_ptr, lane_bits_ptr, T,
                         HAS_COEF: tl.constexpr, DECAY: tl.constexpr, SR: tl.constexpr, BLOCK: tl.constexpr,
                         COUNT: tl.constexpr, L: tl.constexpr, E: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ok = tl.load(ok_ptr) != 0
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = w.to(tl.float32)
    if DECAY:
        p = p * decay
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    # The step as one fused multiply-add, the rest rounded op by op (fp-fusion is off at launch):
    # exactly what the eager ops compute (torch's `add_(g, alpha=-lr)` is an FMA on CUDA).
    p = tl.fma(g, neg_lr, p)
    if SR:
        # Add 16 random bits to the fp32 pattern and keep the high half: rounds the magnitude up
        # with probability equal to the discarded fraction (neutrain.optim.rounding).
        noise = tl.randint(seed, (offs + base).to(tl.uint32)) & 0xFFFF
        bits = p.to(tl.int32, bitcast=True) + noise.to(tl.int32)
        new = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        new = p.to(w.dtype)
    newf = new.to(tl.float32)
    # p is tested as well as the rounded value: CUDA's NaN, 0x7FFFFFFF, plus the rounding noise
    # wraps to a negative pattern whose high half is -0.0, a finite bf16 (optim/rule.py does the same).
    keep = (newf == newf) & (tl.abs(newf) != float("inf")) & (p == p) & (tl.abs(p) != float("inf")) & ok
    stored = tl.where(keep, new, w)
    tl.store(w_ptr + offs, stored, mask=mask)
    if COUNT:  # the encode's pass 1 on the value just stored: the encode then reads the weight once
        _add_lane_bits(stored.to(tl.int16, bitcast=True), base + pid.to(tl.int64) * BLOCK, mask, enc_ptr,
                       lane_bits_ptr, T, L, E, GROUP, BLOCK)


_UPDATE = Launcher(_fused_update_kernel)


def fused_update_(weight: torch.Tensor, grad: torch.Tensor, *, lr: float, weight_decay: float = 0.0,
                  coef: torch.Tensor | None = None, ok: torch.Tensor, seed: int | None = None,
                  base: int = 0, count=None) -> torch.Tensor:
    """Apply LOMO's update to ``weight`` in place, in one kernel (see the module docstring).

    Args:
        weight: contiguous bf16 or fp32 CUDA tensor (a row block of a larger weight is fine).
        grad: a gradient with ``weight.numel()`` elements (bf16 or fp32), contiguous.
        lr, weight_decay: the group's values now.
        coef: the clip coefficient (0-dim fp32 device tensor) or None.
        ok: the gradient's finiteness flag (0-dim bool device tensor).
        seed: stochastic rounding seed (bf16 weights); None rounds to nearest even.
        base: index of ``weight``'s first element in the whole tensor (the noise's counter).
        count: None, or ``(enc_table, lane_bits, (steps, lanes, elems))`` of the compressed tensor this
            bf16 weight will be re-encoded into: the kernel also adds each stored value's code length to
            its lane's count (the encode's pass 1; :mod:`neutrain.compress.counted`).

    Returns:
        ``weight``.

    Example (on a GPU):
        >>> w = torch.ones(4, device="cuda", dtype=torch.bfloat16)           # doctest: +SKIP
        >>> fused_update_(w, torch.ones_like(w), lr=0.5, ok=torch.tensor(True, device="cuda"))  # doctest: +SKIP
        tensor([0.5000, 0.5000, 0.5000, 0.5000], device='cuda:0', dtype=torch.bfloat16)
    """
    if not (weight.is_contiguous() and grad.is_contiguous()) or weight.numel() != grad.numel():
        raise ValueError("fused_update_ needs contiguous weight and gradient of equal size")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fused_update_ updates bf16 or fp32 weights, not {weight.dtype}")
    n = weight.numel()
    if n == 0:
        return weight
    sr = seed is not None and weight.dtype == torch.bfloat16
    decay = 1.0 - lr * weight_decay
    grid = (triton.cdiv(n, BLOCK),)
    if count is not None and weight.dtype != torch.bfloat16:
        raise TypeError("counting code lengths needs a bf16 weight")
    enc_table, lane_bits, (steps, lanes, elems) = count if count is not None else (ok, ok, (1, 1, 1))
    # Through the compiled launcher after the first call (kernels.launch): training calls this once per
    # weight matrix and row chunk, and Triton's dispatch took longer than a small matrix's update.
    _UPDATE(grid, (weight, grad, coef if coef is not None else ok, ok, n, base, -lr, decay,
                   int(seed or 0) & 0x7FFFFFFF, enc_table, lane_bits, steps * lanes * elems),
            {"HAS_COEF": coef is not None, "DECAY": weight_decay != 0.0, "SR": sr, "BLOCK": BLOCK,
             "COUNT": count is not None, "L": lanes, "E": elems, "GROUP": elems if base % elems == 0 else 1},
            **_NO_FUSION)
    return weight
