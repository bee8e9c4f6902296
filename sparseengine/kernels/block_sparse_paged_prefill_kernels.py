"""The Triton kernels behind `block_sparse_paged_prefill`: the block-sparse causal
prefill over the paged cache (`_paged_block_sparse_kernel`: one program per query head,
query tile and request, walking the kept key blocks the host listed, then the diagonal
block) and the column sums of the last rows' probabilities under the same masks
(`_masked_window_colsum_kernel`: one program per request, KV head and key tile).

`block_sparse_paged_prefill` validates, packs the masks and launches them, next to the
torch references they are tested against; its docstring describes the layout. The
kernels keep the names they had there: profiles (results/profile_*.json) list kernels
by name. Importing this module needs no Triton.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import lazy_jit
from .causal_block import causal_paged_block
from .window_rows import paged_key_tile, window_key_probs

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@lazy_jit
def _paged_block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr,
    lists_ptr, counts_ptr, list_off_ptr, count_off_ptr, qk_scale, n_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt, HQ,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STORE_LSE: tl.constexpr, MIN_ROWS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    first = kv_len - q_len  # cache index of the request's first row
    t0 = (first // BLOCK_M + n_tiles - 1 - tl.program_id(1)) * BLOCK_M  # late tiles (more keys) first
    if (q_len >= MIN_ROWS) & (t0 < kv_len):
        kvh = h // GROUP
        offs_m = t0 + tl.arange(0, BLOCK_M)  # cache indices of the tile's rows
        row_ok = (offs_m >= first) & (offs_m < kv_len)
        rows = (q_start + offs_m - first).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = page_table_ptr + b * stride_pt
        qb = t0 // BLOCK_SIZE
        first_qb = first // BLOCK_SIZE
        # this (head, query block)'s list of kept key blocks before the diagonal
        list_off = tl.load(list_off_ptr + b)
        dense = list_off < 0
        row = h * ((kv_len - 1) // BLOCK_SIZE - first_qb + 1) + qb - first_qb
        count = tl.load(counts_ptr + tl.where(dense, 0, tl.load(count_off_ptr + b) + row))
        kept = lists_ptr + tl.where(dense, 0, list_off + row * ((kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE))
        for t in range(0, tl.where(dense, qb, count) * SUB):
            kb = tl.where(dense, t // SUB, tl.load(kept + tl.where(dense, 0, t // SUB)))
            key0 = kb * BLOCK_SIZE + (t % SUB) * BLOCK_N
            keys = key0 + tl.arange(0, BLOCK_N)
            if PAGE_SIZE >= BLOCK_N:  # the tile lies inside one page
                tile_page = tl.load(table + key0 // PAGE_SIZE).to(tl.int64)
                k_rows = tile_page * stride_kp + (keys % PAGE_SIZE)[:, None] * stride_ko
                v_rows = tile_page * stride_vp + (keys % PAGE_SIZE)[:, None] * stride_vo
            else:
                key_pages = tl.load(table + keys // PAGE_SIZE).to(tl.int64)
                k_rows = key_pages[:, None] * stride_kp + (keys % PAGE_SIZE)[:, None] * stride_ko
                v_rows = key_pages[:, None] * stride_vp + (keys % PAGE_SIZE)[:, None] * stride_vo
            kt = tl.load(k_ptr + k_rows + kvh * stride_kh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            st = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale  # all causal, all cached
            mt = tl.maximum(m_i, tl.max(st, 1))
            alpha_t = tl.exp2(m_i - mt)
            pt = tl.exp2(st - mt[:, None])
            l_i = l_i * alpha_t + tl.sum(pt, 1)
            vt = tl.load(v_ptr + v_rows + kvh * stride_vh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            acc = acc * alpha_t[:, None] + tl.dot(pt.to(vt.dtype), vt, input_precision=DOT_PREC)
            m_i = mt
        # the diagonal block, always computed, causal inside (up to the tile's last row)
        for n0 in range(qb * BLOCK_SIZE, tl.minimum(kv_len, t0 + BLOCK_M), BLOCK_N):
            acc, m_i, l_i = causal_paged_block(
                q, acc, m_i, l_i, n0, kv_len, offs_m, table, k_ptr, v_ptr, kvh, qk_scale,
                stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, offs_d, d_ok,
                PAGE_SIZE, BLOCK_N, DOT_PREC, True)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")) * 0.6931471805599453
            tl.store(lse_ptr + rows * HQ + h, lse, mask=row_ok)


@lazy_jit
def _masked_window_colsum_kernel(
    q_ptr, k_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr, masks_ptr, mask_off_ptr, lse_ptr, scores_ptr,
    qk_scale, L, stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_pt, HQ,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, WINDOW: tl.constexpr, W_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    HKV = tl.num_programs(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    first = kv_len - q_len
    first_qb = first // BLOCK_SIZE
    n_q = (kv_len - 1) // BLOCK_SIZE - first_qb + 1
    n_k = (kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    mask_off = tl.load(mask_off_ptr + b)
    w_eff = tl.minimum(q_len, WINDOW)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    kb = offs_n // BLOCK_SIZE
    k = paged_key_tile(k_ptr, page_table_ptr + b * stride_pt, offs_n, n_ok, kvh, stride_kp, stride_ko, stride_kh,
                       offs_d, d_ok, PAGE_SIZE)
    col = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, W_ROWS, BLOCK_R):
        p, ok, pos, hq = window_key_probs(k, offs_n, n_ok, r0 + tl.arange(0, BLOCK_R), q_ptr, lse_ptr, w_eff, q_len,
                                          kv_len, q_start, kvh, qk_scale, stride_qt, stride_qh, offs_d, d_ok, HQ,
                                          GROUP, G_PAD, DOT_PREC)
        qb = pos // BLOCK_SIZE
        # off-diagonal keys of a masked request: read the mask (dense requests and the diagonal: kept)
        look = ok & (kb[None, :] < qb[:, None]) & (mask_off >= 0)
        row_base = (hq * n_q + qb - first_qb).to(tl.int64) * n_k
        keep = tl.load(masks_ptr + tl.maximum(mask_off, 0) + row_base[:, None] + kb[None, :], mask=look, other=1)
        col += tl.sum(tl.where(ok & (keep != 0), p, 0.0), 0)
    tl.store(scores_ptr + (b * HKV + kvh) * L + offs_n, col / GROUP, mask=offs_n < L)
