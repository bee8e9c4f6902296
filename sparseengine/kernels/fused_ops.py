"""The small per-layer ops of a decoder step, fused: RMSNorm (with the residual add before
it), rotary embedding of q and k, and SiLU-and-multiply.

Each Triton kernel replaces several torch ops and reproduces them bit for bit: every
product and sum is rounded to the model dtype where torch rounds it (float32 math,
rounded once, as torch's bf16/fp16 ops do), fp contraction is off (no FMA), and on CUDA
the transcendentals are libdevice's, which nvcc's `expf`/`rsqrtf` are. RMSNorm's mean
of squares is a float32 reduction, so its summation order matters: the kernel sums in
the order ATen's `mean` uses on the tensor's device (CUDA: Reduce.cuh; CPU:
SumKernel.cpp's cascade sum, then divide), see `_cuda_mean_plan`. Not reproduced (the
wrapper raises): CUDA rows of 130561 and longer, which ATen splits across blocks, and
rows of 128 or more that are not a multiple of 4. Not reproducible: on CPU, under the
interpreter, `exp` is numpy's while torch's is SLEEF's, so float32 `silu_mul` may differ
from torch in the last bit there (bfloat16 rounding hides it nearly always).

The model uses `rms_norm`, `add_rms_norm`, `rotary_qk` and `silu_mul`: the kernels on CUDA
tensors, the torch references (the code the model always ran, which matches Hugging
Face token for token) on CPU. `forced` switches either way, for tests.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from . import _common
from ._common import LazyKernel, cdiv, check_launch, interpreting, next_pow2

if TYPE_CHECKING:  # bound at first launch (`_bind_jit_helpers`): importing needs no Triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice

OPS = ("rms_norm", "rotary_qk", "silu_mul")
_forced: dict[str, bool] = {}


@contextlib.contextmanager
def forced(fused: bool, ops: tuple[str, ...] = OPS):
    """Run `ops` as Triton kernels (True; on CPU tensors this needs TRITON_INTERPRET=1) or
    as the torch references (False), whatever the tensors' device. For tests."""
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown fused ops {sorted(unknown)}; valid: {', '.join(OPS)}")
    saved = dict(_forced)
    _forced.update(dict.fromkeys(ops, fused))
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def _fused(op: str, x: torch.Tensor) -> bool:
    return _forced.get(op, x.is_cuda)


# ---------------------------------------------------------------- what the model calls


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_triton(x, weight, eps) if _fused("rms_norm", x) else rms_norm_ref(x, weight, eps)


def add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    fn = add_rms_norm_triton if _fused("rms_norm", x) else add_rms_norm_ref
    return fn(x, residual, weight, eps)


def rotary_qk(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return (rotary_qk_triton if _fused("rotary_qk", q) else rotary_qk_ref)(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_triton(gate_up) if _fused("silu_mul", gate_up) else silu_mul_ref(gate_up)


# ------------------------------------------------------------------ torch references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, d]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rotary_qk_ref(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------- Triton wrappers


def rms_norm_triton(x, weight, eps, *, sum_order: str | None = None) -> torch.Tensor:
    """x [T, N] or [T, H, N], any row strides. `sum_order` ('cuda' or 'cpu'; default: x's
    device) picks whose `mean` summation order to reproduce (tests set it)."""
    return _rms_norm(x, None, weight, eps, sum_order)[0]


def add_rms_norm_triton(x, residual, weight, eps, *, sum_order: str | None = None):
    return _rms_norm(x, residual, weight, eps, sum_order)


def _rms_norm(x, residual, weight, eps, sum_order):
    n = x.shape[-1]
    if x.dim() not in (2, 3) or weight.shape != (n,):
        raise ValueError(f"x must be [T, N] or [T, H, N] with weight [N], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    sum_order = sum_order or x.device.type
    if sum_order not in ("cuda", "cpu"):
        raise ValueError(f"sum_order={sum_order!r}; valid: 'cuda', 'cpu'")
    has_residual = residual is not None
    x, weight = _unit_last_stride(x), weight.contiguous()
    residual = _unit_last_stride(residual) if has_residual else x  # x: a dummy, never read
    device = check_launch(x, residual, weight)
    out = _common.empty(x.shape, torch.promote_types(x.dtype, weight.dtype), device)
    new_residual = _common.empty(x.shape, x.dtype, device) if has_residual else out
    x3, r3 = (x, residual) if x.dim() == 3 else (x[:, None], residual[:, None])
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out, new_residual
    vec, bw, ys = _cuda_mean_plan(n, rows) if sum_order == "cuda" else (1, 1, 1)
    block_n = min(next_pow2(n), 4096)
    _rms_norm_kernel[(rows,)](
        x3, r3, weight, out, new_residual, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        float(np.float32(eps)), float(np.float32(rows) / np.float32(rows * n)),
        N=n, HAS_RESIDUAL=has_residual, CUDA_ORDER=sum_order == "cuda",
        VEC=vec, LOG_BW=bw.bit_length() - 1, LOG_YS=ys.bit_length() - 1,
        CPU_LANES=8 if n >= 8 else 1, BLOCK_N=block_n, INTERPRET=interpreting(),
        num_warps=4 if block_n <= 2048 else 8, **_EXACT,
    )
    return out, new_residual


def _cuda_mean_plan(n: int, rows: int) -> tuple[int, int, int]:
    """How ATen's CUDA `mean` (Reduce.cuh: setReduceConfig, input_vectorized_thread_reduce
    / thread_reduce with vt0 = 4, block_x_reduce, block_y_reduce) sums `rows` contiguous
    float32 rows of `n`: (vec, bw, ys). Thread t = x + y * bw of bw * ys reads vectors
    (vec = 4, n >= 128) or elements (vec = 1) t, t + bw * ys, ... into four accumulators
    (vector lanes, or every fourth element), sums them left to right, then x halves are
    added pairwise (value[x] += value[x + half]) down to one, then y halves likewise."""
    vec = 4 if n >= 128 else 1
    if n % vec:
        raise ValueError(f"rows of {n} >= 128 must be a multiple of 4 (ATen sums unaligned rows "
                         "in an order not reproduced here)")
    floor_pow2 = lambda v: 512 if v >= 512 else 1 << (max(v, 1).bit_length() - 1)  # noqa: E731
    dim0, dim1 = floor_pow2(n // vec), floor_pow2(rows)
    bw = min(dim0, 32)
    bh = min(dim1, 512 // bw)
    bw = min(dim0, 512 // bh)
    split = cdiv(n, bw) >= min(bh * 16, 256)  # rows long enough to spread over the warps too
    if split and cdiv(n, bw * bh) >= 256:
        raise ValueError(f"rows of {n} are too long: ATen splits them across blocks")
    return vec, bw, bh if split else 1


def rotary_qk_triton(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hkv, d] (any token/head strides: views of a fused qkv),
    cos/sin [T, d] -> new contiguous (q, k) rotated."""
    T, hq, d = q.shape
    if k.dim() != 3 or k.shape[0] != T or k.shape[2] != d or cos.shape != (T, d) or sin.shape != (T, d) or d % 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)}: want [T, Hq, d], [T, Hkv, d], [T, d], [T, d] with d even")
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        raise ValueError(f"q, k, cos, sin must share a dtype, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    q, k, cos, sin = (_unit_last_stride(t) for t in (q, k, cos, sin))
    device = check_launch(q, k, cos, sin)
    q_out, k_out = _common.empty(q.shape, q.dtype, device), _common.empty(k.shape, k.dtype, device)
    if T == 0:
        return q_out, k_out
    hkv = k.shape[1]
    _rotary_qk_kernel[(T,)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), hq, hkv,
        HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(d // 2),
        INTERPRET=interpreting(), num_warps=4, **_EXACT,
    )
    return q_out, k_out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] as [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    gate_up = _unit_last_stride(gate_up)
    device = check_launch(gate_up)
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _common.empty((T, inter), gate_up.dtype, device)
    if T == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    _silu_mul_kernel[(T, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, INTERPRET=interpreting(), num_warps=4, **_EXACT,
    )
    return out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# No FMA contraction (torch rounds every product), and libdevice's non-FTZ functions,
# which are what nvcc (so torch) compiles expf/rsqrtf/division to.
_EXACT = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


# ------------------------------------------------------------------------- kernels


class _Kernel(LazyKernel):
    def __getitem__(self, grid):
        _bind_jit_helpers()
        return super().__getitem__(grid)


_helpers_jitted = False
_JIT_HELPERS = ("_round_to", "_load_h", "_sumsq_cuda_order", "_sumsq_cpu_order", "_rotate_heads")


def _bind_jit_helpers() -> None:
    """Compiled kernels can call only jitted functions: jit the helpers (and bind `tl`,
    libdevice) at the first launch, as LazyKernel does the kernels. The interpreter runs
    them as plain Python (jitted, each call would re-patch `tl`: twice as slow)."""
    g = globals()
    if g["_helpers_jitted"]:
        return
    import triton
    import triton.language
    from triton.language.extra.cuda import libdevice as cuda_libdevice

    g["tl"], g["libdevice"] = triton.language, cuda_libdevice
    if not interpreting():
        for name in _JIT_HELPERS:
            g[name] = triton.jit(g[name])
    g["_helpers_jitted"] = True


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
    """sum(h * h) in ATen's CUDA order (`_cuda_mean_plan`)."""
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


@_Kernel
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


@_Kernel
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, HQ, HKV,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = j < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + j, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + j, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF, INTERPRET)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HKV * 2 * HALF, stride_kh, HKV, c1, c2, s1, s2,
                  HALF, BLOCK_HKV, BLOCK_HALF, INTERPRET)


@_Kernel
def _silu_mul_kernel(gu_ptr, out_ptr, stride_t, I, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DTYPE: tl.constexpr = gu_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + t * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_t + I + offs, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    else:  # torch: x / (1 + expf(-x)), IEEE division
        silu = libdevice.div_rn(gate, 1.0 + libdevice.exp(-gate))
    y = _round_to(_round_to(silu, DTYPE, INTERPRET) * up, DTYPE, INTERPRET)
    tl.store(out_ptr + t * I + offs, y.to(DTYPE), mask=mask)
