"""The Triton kernels behind `fused_ops`: RMSNorm (with the residual add before it),
rotary embedding of q and k (alone, or with the KV write), SiLU-and-multiply, and the
jitted helpers they share.

`fused_ops` launches them (its wrappers check shapes and pick the summation plan) and
holds the torch references they reproduce bit for bit; its docstring says how. The
kernels keep the names they had there: profiles (results/profile_*.json) list kernels
by name. `LazyKernel` jits the helpers with the kernels at the first launch (and binds
libdevice); importing this module needs no Triton.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import lazy_jit

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice


def _round_to(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 v rounded (to nearest even) to DTYPE, as float32."""
    if DTYPE == tl.float32:
        return v
    elif INTERPRET and DTYPE == tl.bfloat16:  # the interpreter truncates float32 -> bf16
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(DTYPE).to(tl.float32)


def _load_h(x_row, r_row, offs, mask, HAS_RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr):
    """The normed row's values as float32: x, or x + residual rounded to x's dtype."""
    h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round_to(h + r, x_row.dtype.element_ty, INTERPRET)
    return h


def _sumsq_cuda_order(x_row, r_row, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, VEC: tl.constexpr,
                      LOG_BW: tl.constexpr, LOG_YS: tl.constexpr, INTERPRET: tl.constexpr):
    """sum(h * h) in ATen's CUDA order (`fused_ops._cuda_mean_plan`)."""
    BW: tl.constexpr = 1 << LOG_BW
    YS: tl.constexpr = 1 << LOG_YS
    S: tl.constexpr = BW * YS
    t = tl.arange(0, S)[:, None]
    i = tl.arange(0, 4)[None, :]
    if VEC == 4:
        lane = t * 4 + i  # thread t's vector, lane i
    else:
        lane = t + i * S  # thread t's i-th strided element
    acc = tl.zeros([S, 4], dtype=tl.float32)
    for start in range(0, N, 4 * S):
        offs = start + lane
        h = _load_h(x_row, r_row, offs, offs < N, HAS_RESIDUAL, INTERPRET)
        acc += h * h
    even, odd = tl.split(tl.reshape(acc, [S, 2, 2]))
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    v = tl.reshape(((a0 + a1) + a2) + a3, [YS, BW])
    for _ in tl.static_range(LOG_BW):  # a size-2 sum is one add, in any order
        v = tl.sum(tl.reshape(v, [YS, 2, v.shape[1] // 2]), axis=1)
    v = tl.reshape(v, [YS])
    for _ in tl.static_range(LOG_YS):
        v = tl.sum(tl.reshape(v, [2, v.shape[0] // 2]), axis=0)
    return tl.sum(v, axis=0)


def _sumsq_cpu_order(x_row, r_row, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LANES: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """sum(h * h) in ATen's CPU order (SumKernel.cpp: cascade_sum -> vectorized_inner_sum,
    LANES = 8, the AVX2 kernel, which AVX512 machines run too; LANES = 1 is
    scalar_inner_sum): groups of four vectors summed into four accumulators, cascaded up a
    level every 16 groups; leftover vectors into the first; the four left to right; then
    the scalar tail and the lanes, left to right. Interpreter only: CPU tensors."""
    VECS: tl.constexpr = N // LANES
    GROUPS: tl.constexpr = VECS // 4
    k = tl.arange(0, 4)[:, None]
    lanes = tl.arange(0, LANES)
    zero = tl.zeros([4, LANES], dtype=tl.float32)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero
    for g in tl.static_range(GROUPS):  # level step 16 (level power max(4, ceil_log2(GROUPS) // 4))
        h = _load_h(x_row, r_row, g * 4 * LANES + k * LANES + lanes[None, :], k < 4, HAS_RESIDUAL, INTERPRET)
        acc0 = acc0 + h * h
        if (g + 1) % 16 == 0:
            acc1, acc0 = acc1 + acc0, zero
            if (g + 1) % 256 == 0:
                acc2, acc1 = acc2 + acc1, zero
                if (g + 1) % 4096 == 0:
                    acc3, acc2 = acc3 + acc2, zero
    even, odd = tl.split(tl.reshape(tl.trans(((acc0 + acc1) + acc2) + acc3), [LANES, 2, 2]))
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    for v in tl.static_range(GROUPS * 4, VECS):
        h = _load_h(x_row, r_row, v * LANES + lanes, lanes < LANES, HAS_RESIDUAL, INTERPRET)
        p0 = p0 + h * h
    p0 = ((p0 + p1) + p2) + p3
    one = tl.arange(0, 1)
    tail = tl.zeros([1], dtype=tl.float32)
    for e in tl.static_range(VECS * LANES, N):
        h = _load_h(x_row, r_row, e + one, one < 1, HAS_RESIDUAL, INTERPRET)
        tail = tail + h * h
    p0 = tl.where(lanes == 0, p0 + tail, p0)
    # the interpreter's cumsum is numpy's: left to right
    return tl.sum(tl.where(lanes == LANES - 1, tl.cumsum(p0, axis=0), 0.0), axis=0)


@lazy_jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, B,
    stride_xa, stride_xb, stride_ra, stride_rb, eps, mean_scale,
    N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CUDA_ORDER: tl.constexpr, VEC: tl.constexpr,
    LOG_BW: tl.constexpr, LOG_YS: tl.constexpr, CPU_LANES: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    a, b = (row // B).to(tl.int64), (row % B).to(tl.int64)
    x_row = x_ptr + a * stride_xa + b * stride_xb
    r_row = r_ptr + a * stride_ra + b * stride_rb
    if CUDA_ORDER:
        var = _sumsq_cuda_order(x_row, r_row, N, HAS_RESIDUAL, VEC, LOG_BW, LOG_YS, INTERPRET) * mean_scale
    else:
        var = _sumsq_cpu_order(x_row, r_row, N, HAS_RESIDUAL, CPU_LANES, INTERPRET) / N
    if INTERPRET:
        inv = tl.math.rsqrt(var + eps)  # 1 / sqrt, as torch's CPU rsqrt
    else:
        inv = libdevice.rsqrt(var + eps)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    row_out = row.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < N
        h = _load_h(x_row, r_row, offs, mask, HAS_RESIDUAL, INTERPRET)
        if HAS_RESIDUAL:
            tl.store(r_out_ptr + row_out + offs, h.to(DTYPE), mask=mask)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _round_to(w * _round_to(h * inv, DTYPE, INTERPRET), OUT, INTERPRET)
        tl.store(out_ptr + row_out + offs, y.to(OUT), mask=mask)


def _cos_sin_halves(cos_row, sin_row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's cos and sin, each as its two halves [1, BLOCK_HALF] in float32."""
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = j < HALF
    c1 = tl.load(cos_row + j, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + j, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + j, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + j, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


def _rotate_heads(x_ptr, out_ptr, stride_h, H, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """One token's heads: out = x * cos + rotate_half(x) * sin, each product and the sum
    rounded to the dtype."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (j < HALF)
    src = x_ptr + h * stride_h + j
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _round_to(_round_to(x1 * c1, DTYPE, INTERPRET) + _round_to(-x2 * s1, DTYPE, INTERPRET), DTYPE, INTERPRET)
    o2 = _round_to(_round_to(x2 * c2, DTYPE, INTERPRET) + _round_to(x1 * s2, DTYPE, INTERPRET), DTYPE, INTERPRET)
    dst = out_ptr + h * (2 * HALF) + j
    tl.store(dst, o1.to(DTYPE), mask=mask)
    tl.store(dst + HALF, o2.to(DTYPE), mask=mask)


@lazy_jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, HQ, HKV,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr + t * stride_ct, sin_ptr + t * stride_st, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF, INTERPRET)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HKV * 2 * HALF, stride_kh, HKV, c1, c2, s1, s2,
                  HALF, BLOCK_HKV, BLOCK_HALF, INTERPRET)


@lazy_jit
def _rotary_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcp, stride_kco, stride_vcp, stride_vco, HQ, HKV,
    PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, INTERPRET: tl.constexpr,
):
    """`_rotary_qk_kernel`, with the rotated key and the value written straight to the
    token's cache slot (none for slot -1): one launch instead of the rotation's and the write's."""
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr + t * stride_ct, sin_ptr + t * stride_st, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF, INTERPRET)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
        _rotate_heads(k_ptr + t * stride_kt, k_cache_ptr + page * stride_kcp + off * stride_kco, stride_kh, HKV,
                      c1, c2, s1, s2, HALF, BLOCK_HKV, BLOCK_HALF, INTERPRET)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        c = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        v_mask = (h < HKV) & (c < 2 * HALF)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + c, mask=v_mask)
        tl.store(v_cache_ptr + page * stride_vcp + off * stride_vco + h * (2 * HALF) + c,
                 v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


@lazy_jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_t, I, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                     GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DTYPE: tl.constexpr = gu_ptr.dtype.element_ty
    if GROUP > 0:  # interleaved: GROUP gate features, then their GROUP up features, a block
        gate_at = (offs // GROUP) * (2 * GROUP) + offs % GROUP
        up_at = gate_at + GROUP
    else:  # every gate feature, then every up feature
        gate_at = offs
        up_at = I + offs
    gate = tl.load(gu_ptr + t * stride_t + gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_t + up_at, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    else:  # torch: x / (1 + expf(-x)), IEEE division
        silu = libdevice.div_rn(gate, 1.0 + libdevice.exp(-gate))
    y = _round_to(_round_to(silu, DTYPE, INTERPRET) * up, DTYPE, INTERPRET)
    tl.store(out_ptr + t * I + offs, y.to(DTYPE), mask=mask)
