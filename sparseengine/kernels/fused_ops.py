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

The model uses `rms_norm`, `add_rms_norm`, `rotary_qk` and `silu_mul` (a Triton provider
rotates and writes K/V in one launch, `rotary_kv_write_triton`, where `rotary_qk` would run
its kernel): the kernels on CUDA tensors, the torch references (the code the model always
ran, which matches Hugging Face token for token) on CPU. `forced` switches either way, for tests.

This module holds that dispatch, the torch references and the launch wrappers; the Triton
kernels themselves are in `fused_ops_kernels`.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from . import _common
from ._common import cdiv, check_launch, interpreting, next_pow2
from .fused_ops_kernels import _rms_norm_kernel, _rotary_kv_write_kernel, _rotary_qk_kernel, _silu_mul_kernel

OPS = ("rms_norm", "rotary_qk", "silu_mul")
# Whether an engine on a GPU reserves its model's cos/sin table at load (a decode step then
# gathers its rows instead of computing them, `RotaryEmbedding.reserve`); read when an engine
# loads its model (profile_decode_step.py --kernel-const A/Bs it).
ROTARY_TABLE = True  # A/B session 21 (results/ab_switches_h200.jsonl): Quest b=6 step -0.013 ms, vanilla b=1 -0.01
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


def runs_as_kernel(op: str, x: torch.Tensor) -> bool:
    """Whether the model's `op` runs as its Triton kernel on `x` (CUDA, or forced)."""
    return _fused(op, x)


def silu_mul(gate_up: torch.Tensor, group: int = 0) -> torch.Tensor:
    """`group`: gate_up's features interleaved in blocks of `group` gate then `group` up
    features (the layout `cuda_linear.interleave_gate_up` gives the weight), read in place:
    no de-interleaved copy of a prefill's [T, 2I] activations."""
    return silu_mul_triton(gate_up, group) if _fused("silu_mul", gate_up) else silu_mul_ref(gate_up, group)


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


def silu_mul_ref(gate_up: torch.Tensor, group: int = 0) -> torch.Tensor:
    """[T, 2I] (gate, then up; with `group`, blocks of `group` gate then `group` up
    features) -> silu(gate) * up [T, I]."""
    if not group:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    blocks = gate_up_blocks(gate_up, group)  # a view: nothing copied
    return (F.silu(blocks[..., 0, :]) * blocks[..., 1, :]).reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def gate_up_blocks(gate_up: torch.Tensor, group: int) -> torch.Tensor:
    """An interleaved gate_up output `[..., 2I]` (blocks of `group` gate then `group` up
    features, `cuda_linear.interleave_gate_up`'s layout) as `[..., I / group, 2, group]`:
    index 0 of the block axis the gate features, 1 their up features."""
    _check_group(gate_up.shape[-1], group)
    if not group:
        raise ValueError("gate_up_blocks needs an interleaved layout (group >= 1)")
    return gate_up.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // (2 * group), 2, group)


def _check_group(two_i: int, group) -> None:
    if not isinstance(group, int) or isinstance(group, bool) or group < 0 or (group and two_i % (2 * group)):
        raise ValueError(f"group must be an int >= 0 whose double divides gate_up's {two_i} features, got {group!r}")


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


def rotary_kv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """`rotary_qk_triton` and `paged_kv_write_triton` in one launch: returns q rotated (new,
    contiguous) and writes k rotated and v to the paged caches at `slot_mapping` (-1: not
    written), bit for bit what the two launches give. The caches must be of k's dtype."""
    T, hq, d = q.shape
    hkv = k.shape[1] if k.dim() == 3 else -1
    if (k.dim() != 3 or v.shape != k.shape or k.shape[0] != T or k.shape[2] != d or cos.shape != (T, d)
            or sin.shape != (T, d) or d % 2):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}: "
                         f"want [T, Hq, d], [T, Hkv, d] twice, [T, d] with d even")
    if len({q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"q, k, v, cos, sin and the caches must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}, {cos.dtype}, {sin.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if (k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape
            or k_cache.stride()[2:] != (d, 1) or v_cache.stride()[2:] != (d, 1)):
        raise ValueError(f"caches must be [pages, page_size, {hkv}, {d}] with contiguous heads, got "
                         f"{tuple(k_cache.shape)} strides {k_cache.stride()}")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must be [T={T}], got {tuple(slot_mapping.shape)}")
    q, k, v, cos, sin = (_unit_last_stride(t) for t in (q, k, v, cos, sin))
    device = check_launch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    q_out = _common.empty(q.shape, q.dtype, device)
    if T == 0:
        return q_out
    _rotary_kv_write_kernel[(T,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), hq, hkv,
        PAGE_SIZE=k_cache.shape[1], HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv),
        BLOCK_HALF=next_pow2(d // 2), INTERPRET=interpreting(), num_warps=4, **_EXACT,
    )
    return q_out


def silu_mul_triton(gate_up: torch.Tensor, group: int = 0) -> torch.Tensor:
    """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] as [T, I]; with `group`, `silu_mul_ref`'s
    interleaved blocks."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    _check_group(gate_up.shape[1], group)
    gate_up = _unit_last_stride(gate_up)
    device = check_launch(gate_up)
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _common.empty((T, inter), gate_up.dtype, device)
    if T == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    _silu_mul_kernel[(T, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, INTERPRET=interpreting(), GROUP=group, num_warps=4,
        **_EXACT,
    )
    return out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# No FMA contraction (torch rounds every product), and libdevice's non-FTZ functions,
# which are what nvcc (so torch) compiles expf/rsqrtf/division to.
_EXACT = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
