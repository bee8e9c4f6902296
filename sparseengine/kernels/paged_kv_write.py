"""Write new K/V tokens `[T, Hkv, d]` into the paged NHD caches at `slot_mapping`.

`slot = page_id * page_size + offset`; slot -1 means skip (padding tokens). Values are
cast to the cache dtype.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import check_launch, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def paged_kv_write_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // page_size, slot % page_size] = k[t].to(k_cache.dtype)
        v_cache[slot // page_size, slot % page_size] = v[t].to(v_cache.dtype)


def paged_kv_write_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    T, Hkv, d = k.shape
    if k_cache.shape[2:] != (Hkv, d) or v_cache.shape != k_cache.shape or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)} do not match caches {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous (stride 1)")
    if T == 0:
        return
    check_launch(k, v, k_cache, v_cache, slot_mapping)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Hkv, d, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(d), num_warps=4,
    )


@lazy_jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    HKV, HEAD_DIM, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < HKV)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + page * stride_kcp + off * stride_kco + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = v_cache_ptr + page * stride_vcp + off * stride_vco + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
