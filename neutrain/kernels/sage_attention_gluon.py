"""SageAttention2's forward for Hopper (sm_90) in Gluon: warp-specialized, TMA-fed, ``wgmma`` consumers.

Same math and the same quantized inputs as :mod:`neutrain.kernels.sage_attention` (INT8 Q.K^T
with per-token or per-tile K scales, exp2 online softmax, each KV tile's P in FP8 E4M3 against
the tile's own row max with the fixed scale 448, FP8 P.V (plus the V residual) into a fresh fp32
accumulator per tile, rescaled into the fp32 output accumulator), so the torch reference
:func:`neutrain.attention.reference.sage_reference_forward` is its oracle too. What differs is
the structure, the one the Triton kernel could not get from Triton 3.6
(``benchmarks/attention/NOTES.md``, "Profile of the misses"):

* a **load partition** (one warp) issues the TMA loads of Q and of each KV tile (K, V^T and the
  V residual) into a ring of ``NUM_STAGES`` shared-memory slots, each with a "ready" mbarrier
  (TMA byte count) and an "empty" mbarrier (released by the consumers after their last
  ``wgmma`` on the slot has retired);
* ``NUM_CONSUMERS`` **consumer warpgroups** (the default partition and, with two, a worker
  partition), each owning 64 query rows of the CTA's block: ``wgmma`` INT8 Q.K^T from shared
  memory, the softmax in registers, P converted to the FP8 A operand in registers and the FP8
  ``wgmma`` P.V from shared memory. They share the KV tiles and synchronise only through the
  ring's mbarriers, never through a CTA-wide barrier, so one warpgroup's softmax can run while
  the other's ``wgmma`` occupies the tensor cores (the warp schedulers interleave them);
* optionally (``GluonConfig.pingpong``) FA3's inter-warpgroup ping-pong: two more mbarriers
  hand an MMA "turn" back and forth, so the warpgroups' MMA blocks (tile t's P.V, then tile
  t+1's Q.K^T) strictly alternate and each softmax runs under the other warpgroup's ``wgmma``.

Every ``wgmma`` is waited for at once (no intra-warpgroup overlap of Q.K^T with the softmax: its
registers, 64 int32 scores + 64 fp32 P.V + 64 fp32 output per thread at d=128, leave no room for
a second score tile under the 240 registers a consumer gets).

Not here (the caller routes those to the Triton kernel, see :func:`gluon_supports`): segment
ids / padding masks and Q smoothing. It is written against Triton 3.6's Gluon (the GPU image's)
and needs a Hopper GPU (capability 9.x); :func:`compile_for_sm90` compiles it without a GPU
for machine-code checks.

Example:
    >>> GluonConfig()
    GluonConfig(num_consumers=2, num_stages=3, pingpong=True)
    >>> gluon_block_m(GluonConfig(num_consumers=1))
    64
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

from neutrain.kernels.sage_format import FP8_MAX, LOG2_FP8_MAX, TILE, V_RESIDUAL_GAIN, QuantizedAttentionInputs

#: Query rows per consumer warpgroup: one ``wgmma`` M of 64 per warpgroup.
ROWS_PER_CONSUMER = 64


class GluonConfig(NamedTuple):
    """Launch settings: consumer warpgroups per CTA (1 or 2), KV ring depth, and ``pingpong``
    (two consumers only): FA3's ordering of the two warpgroups' MMA blocks by mbarrier turns."""

    # Three KV stages and ping-pong: the fastest of the smoke's configurations on an H200 (B=4, H=32, 16K, d=128,
    # plain PV; gluon_sage_smoke rows): 752 / 686 TOPS non-causal / causal against 705 / 601 for two stages
    # without ping-pong.
    num_consumers: int = 2
    num_stages: int = 3
    pingpong: bool = True


def gluon_block_m(config: GluonConfig) -> int:
    """Query rows per CTA."""
    return ROWS_PER_CONSUMER * config.num_consumers


#: Triton releases whose Gluon API this kernel is written against. Gluon is experimental and
#: changes between releases (3.9 renamed the TMA copies, for one), so others get the Triton kernel.
GLUON_TRITON_VERSIONS = ("3.6.",)


def gluon_available() -> bool:
    """True when this Triton's Gluon is one this kernel is written for (:data:`GLUON_TRITON_VERSIONS`)."""
    return triton.__version__.startswith(GLUON_TRITON_VERSIONS)


def gluon_supports(qi: QuantizedAttentionInputs, segment_q=None) -> bool:
    """Whether this kernel computes the call: no segments, no Q smoothing, head dim 64 or 128."""
    return segment_q is None and qi.q_mean is None and qi.q_int.shape[-1] in (64, 128)


# Gluon kernels may read module globals only when they are constexpr.
_LOG2_FP8_MAX = gl.constexpr(LOG2_FP8_MAX)
_INV_FP8_MAX = gl.constexpr(1.0 / FP8_MAX)
_INV_V_RESIDUAL_GAIN = gl.constexpr(1.0 / V_RESIDUAL_GAIN)
_FINITE_FLOOR = gl.constexpr(-1e30)  # below any score (|s| < 2**21 * scales)


@gluon.jit
def _int32_to_f32(x):
    # Exact for |x| < 2**22 (|q.k| <= 127*127*128 < 2**21); an integer add and a float
    # subtract instead of the quarter-rate I2F conversion.
    return (x + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0


@gluon.jit
def _tile_count(start_m, N_CTX, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    # Every partition must agree on the CTA's number of KV tiles: the ring's phases depend on it.
    if IS_CAUSAL:
        hi = gl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        hi = N_CTX
    return gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, vr_desc, q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty,
                    start_m, q_row, kv_row, v_row, N_CTX,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    V_RESIDUAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes * NUM_CONSUMERS)
    for c in gl.static_range(NUM_CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row + c * q_desc.block_type.shape[0], 0], q_bar, q_smem.index(c))
    KV_BYTES: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes * (1 + V_RESIDUAL)
    n_tiles = _tile_count(start_m, N_CTX, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for j in range(n_tiles):
        s = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # pass over the ring waits on parity 1 and goes straight through.
        mbarrier.wait(empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, KV_BYTES)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], bar, k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [v_row, j * BLOCK_N], bar, v_smem.index(s))
        if V_RESIDUAL:
            tma.async_copy_global_to_shared(vr_desc, [v_row, j * BLOCK_N], bar, vr_smem.index(s))


@gluon.jit
def _softmax(qk, k_scale, q_scale, rows, cols, m_i, l_i, N_CTX, APPLY_MASK: gl.constexpr, IS_CAUSAL: gl.constexpr,
             K_TILE_SCALE: gl.constexpr, pv_layout: gl.constexpr, p_layout: gl.constexpr):
    """One KV tile's online-softmax step, the reference's: the FP8 P (x448 against the tile's row
    max, as the P.V wgmma's register A operand), the accumulator's rescale factors (alpha for the
    running one, beta/448 for the tile's), new m and l."""
    s = _int32_to_f32(qk)
    if K_TILE_SCALE:
        row_scale = q_scale * k_scale
    else:
        s = s * gl.expand_dims(k_scale, 0)
        row_scale = q_scale
    if APPLY_MASK:
        allowed = gl.expand_dims(cols, 0) < N_CTX
        if IS_CAUSAL:
            allowed = allowed & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
        s = gl.where(allowed, s, float("-inf"))
    m_tile = gl.max(s, 1) * row_scale
    m_new = gl.maximum(m_i, m_tile)
    # A row with no allowed key in this tile (or so far) has a max of -inf; a finite floor keeps
    # exp2(-inf - floor) = 0 where exp2(-inf - -inf) would be NaN. Per row, so unconditional.
    m_tile_safe = gl.maximum(m_tile, _FINITE_FLOOR)
    m_new_safe = gl.maximum(m_new, _FINITE_FLOOR)
    p448 = gl.exp2(s * gl.expand_dims(row_scale, 1) - gl.expand_dims(m_tile_safe - _LOG2_FP8_MAX, 1))
    alpha = gl.exp2(m_i - m_new_safe)
    beta = gl.exp2(m_tile - m_new_safe)
    l_i = l_i * alpha + gl.sum(p448, 1) * (beta * _INV_FP8_MAX)
    p = gl.convert_layout(p448.to(gl.float8e4nv), p_layout)
    alpha_pv = gl.convert_layout(alpha, gl.SliceLayout(1, pv_layout))
    c_pv = gl.convert_layout(beta * _INV_FP8_MAX, gl.SliceLayout(1, pv_layout))
    return p, alpha_pv, c_pv, m_new, l_i


@gluon.jit
def _pv(p, v_tile, vr_tile, acc, V_RESIDUAL: gl.constexpr):
    """P.V (plus the residual's product) into a fresh fp32 accumulator: the first level."""
    zero = gl.zeros_like(acc)
    if V_RESIDUAL:
        # The residual's product seeds the tile accumulator (the Triton kernel's order).
        pv = warpgroup_mma(p, vr_tile, zero, use_acc=False) * _INV_V_RESIDUAL_GAIN
        pv = warpgroup_mma(p, v_tile, pv)
    else:
        pv = warpgroup_mma(p, v_tile, zero, use_acc=False)
    return pv


@gluon.jit
def _qk(q_smem, k_smem, ready, t, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr):
    """Wait for KV tile ``t`` in its ring slot, then the INT8 Q.K^T wgmma (int32 scores)."""
    slot = t % NUM_STAGES
    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    ROWS: gl.constexpr = q_smem.type.shape[0]
    return warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout),
                         use_acc=False)


@gluon.jit
def _k_scale(KS, ks_base, t, cols, BLOCK_N: gl.constexpr, K_TILE_SCALE: gl.constexpr):
    if K_TILE_SCALE:
        return gl.load(ks_base + t * BLOCK_N)
    else:
        return gl.load(ks_base + cols)


@gluon.jit
def _consume(q_smem, k_smem, v_smem, vr_smem, ready, empty, KS, ks_base, N_CTX, lo, hi, m_i, l_i, acc, rows, q_scale,
             APPLY_MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, K_TILE_SCALE: gl.constexpr,
             V_RESIDUAL: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr, pv_layout: gl.constexpr, p_layout: gl.constexpr):
    """KV tiles [lo, hi), one after the other: QK wgmma, softmax, PV wgmma, rescale."""
    for t in range(lo, hi):
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        k_scale = _k_scale(KS, ks_base, t, cols, BLOCK_N, K_TILE_SCALE)
        qk = _qk(q_smem, k_smem, ready, t, NUM_STAGES, s_layout)
        p, alpha, c, m_i, l_i = _softmax(qk, k_scale, q_scale, rows, cols, m_i, l_i, N_CTX, APPLY_MASK, IS_CAUSAL,
                                         K_TILE_SCALE, pv_layout, p_layout)
        slot = t % NUM_STAGES
        pv = _pv(p, v_smem.index(slot).permute((1, 0)), vr_smem.index(slot).permute((1, 0)), acc, V_RESIDUAL)
        # Both wgmma of this slot have retired (synchronous wgmma): the loader may refill it.
        mbarrier.arrive(empty.index(slot))
        acc = acc * gl.expand_dims(alpha, 1) + pv * gl.expand_dims(c, 1)  # second level, fp32
    return m_i, l_i, acc


@gluon.jit
def _consume_pingpong(qk, q_smem, k_smem, v_smem, vr_smem, ready, empty, turn_wait, turn_signal, KS, ks_base, N_CTX,
                      lo, hi, n_tiles, m_i, l_i, acc, rows, q_scale,
                      CONSUMER: gl.constexpr, APPLY_MASK: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      K_TILE_SCALE: gl.constexpr, V_RESIDUAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr, pv_layout: gl.constexpr,
                      p_layout: gl.constexpr):
    """KV tiles [lo, hi) in FA3's inter-warpgroup ping-pong: ``qk`` holds tile ``lo``'s scores; each
    step runs the softmax, then, on this warpgroup's turn, one MMA block (tile t's P.V and tile
    t+1's Q.K^T), hands the turn over and rescales. The two warpgroups' MMA blocks alternate, so
    each one's softmax and rescale run while the other's wgmma hold the tensor cores."""
    for t in range(lo, hi):
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        k_scale = _k_scale(KS, ks_base, t, cols, BLOCK_N, K_TILE_SCALE)
        p, alpha, c, m_i, l_i = _softmax(qk, k_scale, q_scale, rows, cols, m_i, l_i, N_CTX, APPLY_MASK, IS_CAUSAL,
                                         K_TILE_SCALE, pv_layout, p_layout)
        # MMA block t + 1 (block 0 was tile 0's Q.K^T): consumer 0 goes first, a fresh mbarrier
        # passes a wait on parity 1; consumer 1 waits for consumer 0's hand-over.
        mbarrier.wait(turn_wait, ((t + 1) & 1) ^ (1 - CONSUMER))
        slot = t % NUM_STAGES
        pv = _pv(p, v_smem.index(slot).permute((1, 0)), vr_smem.index(slot).permute((1, 0)), acc, V_RESIDUAL)
        mbarrier.arrive(empty.index(slot))
        if t + 1 < n_tiles:
            qk = _qk(q_smem, k_smem, ready, t + 1, NUM_STAGES, s_layout)
        mbarrier.arrive(turn_signal)
        acc = acc * gl.expand_dims(alpha, 1) + pv * gl.expand_dims(c, 1)
    return qk, m_i, l_i, acc


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
              start_m, b, h, hk, H, HK, N_CTX, N_PAD,
              CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              IS_CAUSAL: gl.constexpr, K_TILE_SCALE: gl.constexpr, V_RESIDUAL: gl.constexpr,
              NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup: 64 query rows against all the CTA's KV tiles, then O and the LSE."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    pv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_layout, k_width=4)
    row0 = start_m * BLOCK_M + CONSUMER * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q_scale = gl.load(QS + (b * H + h) * N_PAD + rows)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, pv_layout)
    n_tiles = _tile_count(start_m, N_CTX, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # Tiles wholly inside the allowed region of all 64 rows skip the mask arithmetic.
    if IS_CAUSAL:
        full = gl.minimum(row0 // BLOCK_N, N_CTX // BLOCK_N)
    else:
        full = N_CTX // BLOCK_N
    full = gl.minimum(full, n_tiles)
    ks_base = KS + (b * HK + hk) * N_PAD
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(CONSUMER)
    if PINGPONG:
        gl.static_assert(NUM_STAGES >= 2, "ping-pong keeps two KV tiles in use per warpgroup")
        turn_wait = turn.index(CONSUMER)
        turn_signal = turn.index(1 - CONSUMER)
        mbarrier.wait(turn_wait, 1 - CONSUMER)  # MMA block 0: tile 0's Q.K^T, consumer 0 first
        qk = _qk(q, k_smem, ready, 0, NUM_STAGES, s_layout)
        mbarrier.arrive(turn_signal)
        qk, m_i, l_i, acc = _consume_pingpong(qk, q, k_smem, v_smem, vr_smem, ready, empty, turn_wait, turn_signal, KS,
                                              ks_base, N_CTX, 0, full, n_tiles, m_i, l_i, acc, rows, q_scale, CONSUMER,
                                              False, IS_CAUSAL, K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, BLOCK_N,
                                              s_layout, pv_layout, p_layout)
        qk, m_i, l_i, acc = _consume_pingpong(qk, q, k_smem, v_smem, vr_smem, ready, empty, turn_wait, turn_signal, KS,
                                              ks_base, N_CTX, full, n_tiles, n_tiles, m_i, l_i, acc, rows, q_scale,
                                              CONSUMER, True, IS_CAUSAL, K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, BLOCK_N,
                                              s_layout, pv_layout, p_layout)
    else:
        m_i, l_i, acc = _consume(q, k_smem, v_smem, vr_smem, ready, empty, KS, ks_base, N_CTX, 0, full, m_i, l_i, acc,
                                 rows, q_scale, False, IS_CAUSAL, K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, BLOCK_N,
                                 s_layout, pv_layout, p_layout)
        m_i, l_i, acc = _consume(q, k_smem, v_smem, vr_smem, ready, empty, KS, ks_base, N_CTX, full, n_tiles, m_i, l_i,
                                 acc, rows, q_scale, True, IS_CAUSAL, K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, BLOCK_N,
                                 s_layout, pv_layout, p_layout)
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    gl.store(LSE + (b * H + h) * N_PAD + rows, gl.where(empty_row, float("inf"), m_i + gl.log2(l_safe)))
    rows_o = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, pv_layout))
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, pv_layout))
    v_scale = gl.load(VS + (b * HK + hk) * HEAD_DIM + cols_o)
    l_pv = gl.convert_layout(l_safe, gl.SliceLayout(1, pv_layout))
    out = acc / gl.expand_dims(l_pv, 1) * gl.expand_dims(v_scale, 0)
    o_off = ((b * H + h) * N_CTX + gl.expand_dims(rows_o, 1)) * HEAD_DIM + gl.expand_dims(cols_o, 0)
    gl.store(O + o_off, out.to(O.dtype.element_ty), mask=gl.expand_dims(rows_o, 1) < N_CTX)


@gluon.jit
def _consumer_1(q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
                start_m, b, h, hk, H, HK, N_CTX, N_PAD,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                IS_CAUSAL: gl.constexpr, K_TILE_SCALE: gl.constexpr, V_RESIDUAL: gl.constexpr,
                NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
              start_m, b, h, hk, H, HK, N_CTX, N_PAD, 1, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL,
              K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, PINGPONG)


@gluon.jit
def sage_fwd_gluon_kernel(q_desc, k_desc, v_desc, vr_desc, QS, KS, VS, O, LSE, H, N_CTX, N_PAD, GROUPS,
                          HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                          NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, K_TILE_SCALE: gl.constexpr,
                          V_RESIDUAL: gl.constexpr, PINGPONG: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = ROWS * NUM_CONSUMERS
    # Causal: the heaviest query blocks (the last ones) start first, for a shorter tail.
    start_m = gl.program_id(0) if not IS_CAUSAL else gl.num_programs(0) - 1 - gl.program_id(0)
    b, h = gl.program_id(1) // H, gl.program_id(1) % H
    HK, hk = H // GROUPS, h // GROUPS  # GQA: this query head reads K/V head hk

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    if V_RESIDUAL:
        vr_smem = gl.allocate_shared_memory(vr_desc.dtype, [NUM_STAGES] + vr_desc.block_type.shape,
                                            vr_desc.layout)
    else:
        vr_smem = v_smem
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ping-pong's MMA turns
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)  # every consumer releases each slot

    q_row = (b * H + h) * N_PAD + start_m * BLOCK_M
    kv_row = (b * HK + hk) * N_PAD
    v_row = (b * HK + hk) * HEAD_DIM
    gl.static_assert(NUM_CONSUMERS == 2 or not PINGPONG, "ping-pong needs two consumer warpgroups")
    # (Argument tuples are spelled out: a tuple concatenation in Gluon turns constexprs into tensors.)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
                         start_m, b, h, hk, H, HK, N_CTX, N_PAD, 0, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL,
                         K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, PINGPONG)),
            (_consumer_1, (q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
                           start_m, b, h, hk, H, HK, N_CTX, N_PAD, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL,
                           K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, PINGPONG)),
            (_load_partition, (q_desc, k_desc, v_desc, vr_desc, q_smem, k_smem, v_smem, vr_smem, q_bar, ready,
                               empty, start_m, q_row, kv_row, v_row, N_CTX, BLOCK_M, BLOCK_N, IS_CAUSAL,
                               V_RESIDUAL, NUM_STAGES, NUM_CONSUMERS)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, vr_smem, q_bar, ready, empty, turn, QS, KS, VS, O, LSE,
                         start_m, b, h, hk, H, HK, N_CTX, N_PAD, 0, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL,
                         K_TILE_SCALE, V_RESIDUAL, NUM_STAGES, False)),
            (_load_partition, (q_desc, k_desc, v_desc, vr_desc, q_smem, k_smem, v_smem, vr_smem, q_bar, ready,
                               empty, start_m, q_row, kv_row, v_row, N_CTX, BLOCK_M, BLOCK_N, IS_CAUSAL,
                               V_RESIDUAL, NUM_STAGES, NUM_CONSUMERS)),
        ], [1], [24])


def _descriptors(qi: QuantizedAttentionInputs, rows: int):
    """Host TMA descriptors over 2-D views: Q [B*Hq*Np, D], K [B*Hk*Np, D], V^T and its residual [B*Hk*D, Np]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, n_pad, d = qi.q_int.shape
    hk = qi.k_int.shape[1]

    def desc(t, shape2d, block, dtype):
        view = t.reshape(shape2d)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))

    q = desc(qi.q_int, (b * h * n_pad, d), [rows, d], gl.int8)
    k = desc(qi.k_int, (b * hk * n_pad, d), [TILE, d], gl.int8)
    v = desc(qi.v_fp8_t, (b * hk * d, n_pad), [d, TILE], gl.float8e4nv)
    vr_src = qi.v_residual_t if qi.v_residual_t is not None else qi.v_fp8_t
    vr = desc(vr_src, (b * hk * d, n_pad), [d, TILE], gl.float8e4nv)
    return q, k, v, vr


#: The compiled kernel of the latest launch, for machine-code checks.
_LAST_LAUNCH: dict = {}


def sage_attention_forward_gluon(qi: QuantizedAttentionInputs, causal: bool, segment_q=None, segment_k=None,
                                 out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None):
    """Launch the Gluon forward: ``(out [B,Hq,N,D], lse [B,Hq,Np] fp32)``, as
    :func:`neutrain.kernels.sage_attention.sage_attention_forward` returns them.

    Raises ``ValueError`` for what :func:`gluon_supports` rejects (segments, Q smoothing).
    """
    if not gluon_supports(qi, segment_q):
        raise ValueError("the Gluon forward takes no segment ids and no Q smoothing; use the Triton kernel")
    config = config or GluonConfig()
    b, h, n_pad, d = qi.q_int.shape
    groups = h // qi.k_int.shape[1]
    n = qi.seq_len
    out = torch.empty((b, h, n, d), dtype=out_dtype, device=qi.q_int.device)
    lse = torch.full((b, h, n_pad), float("inf"), dtype=torch.float32, device=qi.q_int.device)
    block_m = gluon_block_m(config)
    q_desc, k_desc, v_desc, vr_desc = _descriptors(qi, ROWS_PER_CONSUMER)
    grid = (triton.cdiv(n, block_m), b * h)
    _LAST_LAUNCH["forward"] = sage_fwd_gluon_kernel[grid](
        q_desc, k_desc, v_desc, vr_desc, qi.q_scale, qi.k_scale, qi.v_scale, out, lse, h, n, n_pad, groups,
        HEAD_DIM=d, BLOCK_N=TILE, NUM_CONSUMERS=config.num_consumers, NUM_STAGES=config.num_stages,
        IS_CAUSAL=causal, K_TILE_SCALE=qi.k_group == TILE, V_RESIDUAL=qi.v_residual_t is not None,
        PINGPONG=config.pingpong, num_warps=4, **_launch_options(config))
    return out, lse


def _launch_options(config: GluonConfig) -> dict:
    # Two consumer warpgroups + the load warp occupy 3 warpgroups (12 warps): 168 registers per
    # thread at launch fit the 64K register file; the load warpgroup gives its registers back
    # (24) and each consumer takes 240.
    return {"maxnreg": 168} if config.num_consumers == 2 else {}


def sass_summary(compiled) -> dict:
    """Opcode counts (``{"IGMMA": 16, ...}``, by mnemonic before the first dot), registers per
    thread and spill instructions of a compiled kernel, read with the ``cuobjdump`` that Triton ships."""
    import collections
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0]
                              for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    regs = re.search(r"REG:(\d+)", usage)
    return {"opcodes": dict(ops), "registers": int(regs.group(1)) if regs else None,
            "spills": ops["STL"] + ops["LDL"], "sass": sass}


def compile_for_sm90(head_dim: int = 128, causal: bool = False, config: GluonConfig | None = None,
                     k_tile_scale: bool = True, v_residual: bool = True):
    """Compile the kernel for an H100 (``sm_90``) without a GPU; returns the compiled kernel
    (``.asm['sass']`` when Triton can disassemble, ``.asm['cubin']``, ``.n_regs``, ``.n_spills``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    config = config or GluonConfig()

    def desc(dtype, name, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "q_desc": desc(gl.int8, "i8", [ROWS_PER_CONSUMER, head_dim]),
        "k_desc": desc(gl.int8, "i8", [TILE, head_dim]),
        "v_desc": desc(gl.float8e4nv, "fp8e4nv", [head_dim, TILE]),
        "vr_desc": desc(gl.float8e4nv, "fp8e4nv", [head_dim, TILE]),
        "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "O": "*bf16", "LSE": "*fp32",
        "H": "i32", "N_CTX": "i32", "N_PAD": "i32", "GROUPS": "i32",
    }
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_N": TILE, "NUM_CONSUMERS": config.num_consumers,
                  "NUM_STAGES": config.num_stages, "IS_CAUSAL": causal, "K_TILE_SCALE": k_tile_scale,
                  "V_RESIDUAL": v_residual, "PINGPONG": config.pingpong}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = GluonASTSource(fn=sage_fwd_gluon_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, **_launch_options(config)})
