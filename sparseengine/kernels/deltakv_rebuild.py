"""DeltaKV: rebuild chosen tokens' K/V from latents.

`kv = z @ up + mean`, with `z [N, r]`, `up [r, 2 * Hkv * d]`, `mean [N, 2 * Hkv * d]`
(the mean of each token's centers); columns `[0, Hkv*d)` are K (pre-RoPE) and
`[Hkv*d, 2*Hkv*d)` are V, each head-major (`[Hkv, d]` flattened). K is then rotated at
`positions [N]` with `cos/sin [max_pos, d]` in the rotate_half (Llama/HF) convention:
`k * cos + rotate_half(k) * sin`, `rotate_half(x) = cat(-x[d/2:], x[:d/2])`.
Returns `(k [N, Hkv, d], v [N, Hkv, d])` in `out_dtype` (default: `mean.dtype`), ready
for `paged_kv_write`. Quantized latents are dequantized by the caller.

Triton: one program per (tile of BLOCK_M tokens, KV head) for K and one for V; the
d/2 halves are two fp32 accumulators so RoPE is applied in registers before the store.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import cdiv, check_launch, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def deltakv_rebuild_ref(z, up, mean, positions, cos, sin, num_kv_heads, out_dtype=None):
    N = z.shape[0]
    d = up.shape[1] // (2 * num_kv_heads)
    kv = z.float() @ up.float() + mean.float()
    k = kv[:, : num_kv_heads * d].reshape(N, num_kv_heads, d)
    v = kv[:, num_kv_heads * d:].reshape(N, num_kv_heads, d)
    c = cos[positions.long()].float()[:, None, :]
    s = sin[positions.long()].float()[:, None, :]
    rotated = torch.cat([-k[..., d // 2:], k[..., : d // 2]], dim=-1)
    k = k * c + rotated * s
    dtype = out_dtype or mean.dtype
    return k.to(dtype), v.to(dtype)


def deltakv_rebuild_triton(z, up, mean, positions, cos, sin, num_kv_heads, out_dtype=None):
    N, r = z.shape
    width = up.shape[1]
    if width % (2 * num_kv_heads) or up.shape[0] != r or tuple(mean.shape) != (N, width):
        raise ValueError(f"shapes do not match: z {tuple(z.shape)}, up {tuple(up.shape)}, mean {tuple(mean.shape)}")
    d = width // (2 * num_kv_heads)
    if d % 2 or cos.shape[-1] != d or sin.shape != cos.shape:
        raise ValueError(f"head_dim {d} must be even and match cos/sin {tuple(cos.shape)}")
    device = check_launch(z, up, mean, positions, cos, sin)
    z = z.to(up.dtype).contiguous()
    up, mean, cos, sin = up.contiguous(), mean.contiguous(), cos.contiguous(), sin.contiguous()
    dtype = out_dtype or mean.dtype
    k = _common.empty((N, num_kv_heads, d), dtype, device)
    v = _common.empty((N, num_kv_heads, d), dtype, device)
    if N == 0:
        return k, v
    block_m = 64 if device.type == "cuda" else 16
    for is_key, out in ((True, k), (False, v)):
        _rebuild_kernel[(cdiv(N, block_m), num_kv_heads)](
            z, up, mean, positions, cos, sin, out, N, r, width,
            IS_KEY=is_key, HKV=num_kv_heads, HALF=d // 2, BLOCK_HALF=max(16, next_pow2(d // 2)),
            BLOCK_M=block_m, BLOCK_R=max(16, min(64, next_pow2(r))),
            DOT_PREC=_common.dot_precision(up.dtype), num_warps=4,
        )
    return k, v


@lazy_jit
def _rebuild_kernel(
    z_ptr, up_ptr, mean_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, N, R, WIDTH,
    IS_KEY: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kvh = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_HALF)
    m_ok = offs_m < N
    c_ok = offs_c < HALF
    col0 = (0 if IS_KEY else HKV * 2 * HALF) + kvh * 2 * HALF
    lo_cols = col0 + offs_c
    hi_cols = col0 + HALF + offs_c
    acc_lo = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        z = tl.load(z_ptr + offs_m[:, None] * R + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        w_mask = r_ok[:, None] & c_ok[None, :]
        w_lo = tl.load(up_ptr + offs_r[:, None] * WIDTH + lo_cols[None, :], mask=w_mask, other=0.0)
        w_hi = tl.load(up_ptr + offs_r[:, None] * WIDTH + hi_cols[None, :], mask=w_mask, other=0.0)
        acc_lo += tl.dot(z, w_lo, input_precision=DOT_PREC)
        acc_hi += tl.dot(z, w_hi, input_precision=DOT_PREC)
    mask = m_ok[:, None] & c_ok[None, :]
    row = offs_m.to(tl.int64)[:, None] * WIDTH
    x_lo = acc_lo + tl.load(mean_ptr + row + lo_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_hi = acc_hi + tl.load(mean_ptr + row + hi_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_KEY:
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)[:, None] * (2 * HALF)
        cos_lo = tl.load(cos_ptr + pos + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + pos + HALF + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + pos + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + pos + HALF + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        x_lo, x_hi = x_lo * cos_lo - x_hi * sin_lo, x_hi * cos_hi + x_lo * sin_hi
    out = out_ptr + offs_m.to(tl.int64)[:, None] * (HKV * 2 * HALF) + kvh * 2 * HALF + offs_c[None, :]
    tl.store(out, x_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, x_hi.to(out_ptr.dtype.element_ty), mask=mask)
