"""Quest page metadata: the per-page per-channel bounds of the keys.

`update_page_minmax_*(k_cache, slot_mapping, kmax, kmin)`: after K was written at
`slot_mapping`, refresh `kmax/kmin [num_pages, Hkv, d]`, the per-page per-channel max/min
of the keys. Writing offset 0 of a page resets it. Call it after `paged_kv_write`.
`update_page_minmax_torch` is the vectorised CPU twin of the Triton update (the same
rule, below; boolean indexing, so it syncs on CUDA): no loop over slots. The page scores
that read the bounds are `quest_scores.py`'s (on a decode step they fold the step's keys
in themselves, instead of this update).

Triton update: tokens are appended in order, so a page's metadata after this step is
the max/min over its cached offsets 0..o, o = the largest offset written to it now. One
program per (slot, KV head); only the programs holding that largest offset recompute the
page from the cache (up to page_size tokens), so there are no races and no atomics,
whatever the order of `slot_mapping`. The check scans `slot_mapping` (O(T) per slot, trivial for
decode; for a prefill chunk the next slot usually answers it at once).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import check_launch, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def update_page_minmax_ref(k_cache, slot_mapping, kmax, kmin) -> None:
    page_size = k_cache.shape[1]
    for slot in slot_mapping.tolist():
        if slot < 0:
            continue
        page, off = slot // page_size, slot % page_size
        k = k_cache[page, off].to(kmax.dtype)
        if off == 0:
            kmax[page], kmin[page] = k, k
        else:
            kmax[page] = torch.maximum(kmax[page], k)
            kmin[page] = torch.minimum(kmin[page], k)


def update_page_minmax_torch(k_cache, slot_mapping, kmax, kmin) -> None:
    """Vectorised update: each page written this step gets the max/min over its cached
    offsets ``0..o``, ``o`` = the largest offset written to it now (slots -1 skipped)."""
    num_pages, page_size = k_cache.shape[:2]
    slots = slot_mapping[slot_mapping >= 0].long()
    if slots.numel() == 0:
        return
    pages, offs = slots // page_size, slots % page_size
    last = torch.full((num_pages,), -1, dtype=torch.long, device=slots.device)
    last.scatter_reduce_(0, pages, offs, "amax")
    owner = offs == last[pages]  # one slot per written page: the one at its largest offset
    pages, upto = pages[owner], offs[owner]
    k = k_cache[pages].to(kmax.dtype)  # [m, page_size, Hkv, d]
    seen = (torch.arange(page_size, device=k.device)[None, :] <= upto[:, None])[:, :, None, None]
    kmax[pages] = k.masked_fill(~seen, float("-inf")).amax(1)
    kmin[pages] = k.masked_fill(~seen, float("inf")).amin(1)


def update_page_minmax_triton(k_cache, slot_mapping, kmax, kmin) -> None:
    num_pages, page_size, Hkv, d = k_cache.shape
    if kmax.shape != (num_pages, Hkv, d) or kmin.shape != kmax.shape:
        raise ValueError(f"kmax/kmin must be [{num_pages}, {Hkv}, {d}], got {tuple(kmax.shape)}")
    if not (kmax.is_contiguous() and kmin.is_contiguous()):
        raise ValueError("kmax/kmin must be contiguous")
    T = slot_mapping.shape[0]
    if T == 0:
        return
    check_launch(k_cache, slot_mapping, kmax, kmin)
    _minmax_kernel[(T, Hkv)](
        k_cache, slot_mapping, kmax, kmin, T,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), Hkv,
        PAGE_SIZE=page_size, BLOCK_O=next_pow2(page_size), HEAD_DIM=d, BLOCK_D=next_pow2(d),
        BLOCK_T=min(1024, next_pow2(T)), num_warps=4,
    )


@lazy_jit
def _minmax_kernel(
    k_ptr, slot_ptr, kmax_ptr, kmin_ptr, T, stride_kp, stride_ko, stride_kh, HKV,
    PAGE_SIZE: tl.constexpr, BLOCK_O: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    # Another slot of this page with a larger offset owns the refresh; the next slot
    # usually tells (prefill chunks are in order), else scan them all.
    nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < T, other=-1).to(tl.int64)
    if (slot >= 0) & ((nxt < 0) | (nxt // PAGE_SIZE != page) | (nxt % PAGE_SIZE <= off)):
        n_later = tl.zeros([BLOCK_T], tl.int32)
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            other = tl.load(slot_ptr + offs_t, mask=offs_t < T, other=-1).to(tl.int64)
            later = (other >= 0) & (other // PAGE_SIZE == page) & (other % PAGE_SIZE > off)
            n_later += later.to(tl.int32)
        if tl.sum(n_later, 0) == 0:
            offs_o = tl.arange(0, BLOCK_O)
            offs_d = tl.arange(0, BLOCK_D)
            mask = (offs_o <= off)[:, None] & (offs_d < HEAD_DIM)[None, :]
            h = tl.program_id(1)  # one KV head per program: the heads' loads run in parallel
            ptrs = k_ptr + page * stride_kp + offs_o[:, None] * stride_ko + h * stride_kh + offs_d[None, :]
            k = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            hi = tl.max(tl.where(mask, k, float("-inf")), 0)
            lo = tl.min(tl.where(mask, k, float("inf")), 0)
            meta = (page * HKV + h) * HEAD_DIM + offs_d
            tl.store(kmax_ptr + meta, hi.to(kmax_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
            tl.store(kmin_ptr + meta, lo.to(kmin_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
