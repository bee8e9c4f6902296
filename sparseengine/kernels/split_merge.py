"""Merging split-K partials: each query row's chunks' (normalised output, log2-domain
log-sum-exp) pairs into its output (and lse, natural log). `merge_splits` is called by
the split kernel's last program of a row (`paged_decode.MERGE_IN_SPLIT_KERNEL`) and by
the merge kernel, `_combine_splits_kernel`, which `split_k_decode` launches after the
split kernel: a program per (query row, channel tile), the row's chunks found in the
(row, split) grid's slots or, under the balanced plan, through its `[rows, 2]` plan.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import lazy_jit, shared_helper
from .pdl import pdl_trigger

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@lazy_jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, meta_ptr, num_splits, stride_ob, stride_oh, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
    GROUP: tl.constexpr, BALANCED: tl.constexpr, TRIGGER: tl.constexpr,
):
    pdl_trigger(TRIGGER)  # the o projection after it may start loading its weights (pdl.py)
    row = tl.program_id(0)
    if BALANCED:  # the row's chunks are numbered in `meta`; a row of one chunk wrote its output
        kv_row = (row // HQ) * (HQ // GROUP) + (row % HQ) // GROUP
        first = tl.load(meta_ptr + 2 * kv_row)
        n_read = tl.load(meta_ptr + 2 * kv_row + 1)
        if n_read > 1:
            merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, row, first * GROUP + row % HQ % GROUP,
                          GROUP, tl.program_id(1) * BLOCK_D, n_read, stride_ob, stride_oh, HQ, HEAD_DIM, BLOCK_D,
                          BLOCK_S, STORE_LSE)
    else:
        merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, row, row * num_splits, 1,
                      tl.program_id(1) * BLOCK_D, num_splits, stride_ob, stride_oh, HQ, HEAD_DIM, BLOCK_D, BLOCK_S,
                      STORE_LSE)


@shared_helper
def merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, row, base, step, d_start, n_read, stride_ob,
                  stride_oh, HQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  STORE_LSE: tl.constexpr):
    """Merge query row `row` = b * HQ + h, channels `d_start .. d_start + BLOCK_D`: its
    `n_read` log2-domain partials, at slots `base + s * step` -> out (and, from the
    channels starting at 0, lse, natural log); a partial of weight 0 (lse -inf: a split
    without items, whose output slot was never written) is not loaded. Loads bypass L1
    (.cg): in the fused kernel other programs wrote the partials just now."""
    b = row // HQ
    h = row % HQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d_start + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_read, BLOCK_S):
        m_vec = tl.maximum(m_vec, tl.load(part_lse_ptr + base + (s0 + offs_s) * step, mask=s0 + offs_s < n_read,
                                          other=float("-inf"), cache_modifier=".cg"))
    m = tl.max(m_vec, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_D], tl.float32)
    w_vec = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, n_read, BLOCK_S):
        s_mask = s0 + offs_s < n_read
        slots = base + (s0 + offs_s) * step
        w = tl.exp2(tl.load(part_lse_ptr + slots, mask=s_mask, other=float("-inf"), cache_modifier=".cg") - m)
        o = tl.load(part_out_ptr + slots[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                    mask=(s_mask & (w > 0))[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(w[:, None] * o, 0)
        w_vec += w
    w_sum = tl.sum(w_vec, 0)
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if STORE_LSE:
        if d_start == 0:
            lse = tl.where(w_sum > 0, m + tl.log2(tl.where(w_sum > 0, w_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + row, lse * 0.6931471805599453)
