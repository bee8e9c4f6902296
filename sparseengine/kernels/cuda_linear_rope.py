"""The decode step's qkv projection with the rotary embedding and the KV write in its
epilogue (`cuda_linear.cu`'s ROPE kernel): one launch for what the model otherwise does in
two (`cuda_linear`, then `fused_ops.rotary_kv_write_triton`).

`qkv_rope(x, weight, ...)` -> q rotated `[rows, Hq, 128]`; k rotated and v are written to
the paged caches at `slot_mapping` (-1: not written). The weight is qkv's own `[(Hq + 2 Hkv)
* 128, K]` in the model's row order: the kernel pairs each q and k head's dims j .. j + 7
with j + 64 .. j + 71 as it loads them, so no layout changes at load and the prefill path
is untouched. Each value is rounded as the two launches round it (the projection to bf16,
then each rotary product and their sum), so the result is theirs bit for bit;
`qkv_rope_ref` is the torch oracle (the model's ops).

`ENGINE` (read at each call) lets the model take it. On the H200 (session 45, b=6 at 128K,
alternating graph-step profiles, two rounds) it took OmniKV's step from 8.421 / 8.426 ms to
8.380 / 8.370 and Quest's from 8.184 / 8.194 to 8.130 / 8.130: one launch a layer fewer, the
kernel 29.0-29.2 us a layer where qkv and the rotary took 27.6-27.7 + 2.5
(results/cuda_linear_rope_ab_s45_h200.jsonl).
"""
from __future__ import annotations

import torch

from . import _common, cuda_linear
from .fused_ops import rotary_qk_ref
from .paged_kv_write import paged_kv_write_ref

ENGINE = True
HEAD_DIM = 128  # the kernel's (rotate-half pairs j and j + 64)


def takes(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether the model's qkv can run this kernel on `x`: `ENGINE` on, `cuda_linear.takes`,
    heads of `HEAD_DIM`."""
    return ENGINE and head_dim == HEAD_DIM and cuda_linear.takes(x, weight)


def qkv_rope_ref(x, weight, *, rms_eps, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """The model's ops: the projection (`cuda_linear_ref`), the rotation (`rotary_qk_ref`),
    the write (`paged_kv_write_ref`) -> q rotated `[rows, Hq, d]`."""
    rows, d = x.numel() // x.shape[-1], HEAD_DIM
    y = cuda_linear.cuda_linear_ref(x.reshape(rows, -1), weight, rms_eps=rms_eps)
    q, k, v = y.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = rotary_qk_ref(q.reshape(rows, num_heads, d), k.reshape(rows, num_kv_heads, d), cos, sin)
    paged_kv_write_ref(k, v.reshape(rows, num_kv_heads, d), k_cache, v_cache, slot_mapping)
    return q


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, *, rms_eps: float | None, cos: torch.Tensor,
             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             num_heads: int, num_kv_heads: int, pdl: bool | None = None, staged: bool | None = None) -> torch.Tensor:
    """`x [..., K]` bf16 (1-8 rows), `weight [(Hq + 2 Hkv) * 128, K]` -> q rotated `[rows, Hq,
    128]`; k rotated and v written to `k_cache` / `v_cache` `[pages, page_size, Hkv, 128]`
    (heads contiguous) at `slot_mapping [rows]` int64. `cos`, `sin` `[rows, 128]` bf16.
    `pdl`, `staged`: `cuda_linear`'s."""
    rows = cuda_linear.check_launch_args(x, weight, rms_eps)
    d = HEAD_DIM
    if num_heads < 1 or num_kv_heads < 1 or weight.shape[0] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv's weight must have (Hq + 2 Hkv) * {d} rows for Hq={num_heads}, Hkv={num_kv_heads}, "
                         f"got {weight.shape[0]}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (rows, d) or t.dtype != x.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [{rows}, {d}] {x.dtype} with unit last stride, got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin must share a row stride, got {cos.stride(0)} and {sin.stride(0)}")
    if cos.stride(0) % 8 or cos.data_ptr() % 16 or sin.data_ptr() % 16:  # the kernel loads them 16 B at a time
        raise ValueError(f"cos and sin must start 16-byte aligned with a row stride a multiple of 8, got stride "
                         f"{cos.stride(0)} at byte offsets {cos.data_ptr() % 16} and {sin.data_ptr() % 16}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dim() != 4 or tuple(c.shape[2:]) != (num_kv_heads, d) or c.dtype != x.dtype
                or c.stride()[2:] != (d, 1) or c.shape != k_cache.shape):
            raise ValueError(f"{name} must be [pages, page_size, {num_kv_heads}, {d}] {x.dtype} with contiguous "
                             f"heads, like k_cache; got {tuple(c.shape)} {c.dtype} strides {c.stride()}")
    if tuple(slot_mapping.shape) != (rows,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{rows}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    tensors = (x, weight, cos, sin, k_cache, v_cache, slot_mapping)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"every tensor must be on x's device, got {[str(t.device) for t in tensors]}")
    so, staged, x2 = cuda_linear.launch_plan(x, weight, rows, staged, rope=True)
    n, k = weight.shape
    slots = slot_mapping.contiguous()
    q = _common.empty((rows, num_heads, d), x.dtype, x.device)
    err = cuda_linear.on_device(
        x, so.se_linear_rope, x2.data_ptr(), weight.data_ptr(), q.data_ptr(), rows, n, k, float(rms_eps or 0.0),
        int(rms_eps is not None), int(staged), int(cuda_linear.PDL if pdl is None else pdl), cos.data_ptr(),
        sin.data_ptr(), cos.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), k_cache.shape[1], slots.data_ptr(), num_heads, num_kv_heads,
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"cuda_linear_rope's launch failed: error {err} (M={rows}, N={n}, K={k}, staged={staged})")
    return q
