"""Attention probability mass received per cached token (H2O and SnapKV scores).

`decode_colsum_*`: decode attention that also returns `colsum [B, Hkv, max_kv_len]`
(`max_kv_len`: at least every row's length; default the longest),
the probability each token received at this step, averaged over the g query heads of its
KV head (zeros past `kv_lens`). `prefill_window_colsum_*`: for the last `window` queries
of each request in a packed prefill batch, per-token sums of the causal softmax rows
(SnapKV step 3), averaged over the g heads of each KV head (rows: the last
min(window, q_len) new queries; tokens past kv_len are 0).

Why two passes and no second attention: the decode split kernel stores the scaled logits
of the group's heads while it runs the normal attention (g * 4 bytes per token per KV
head, against 2 * d * 2 bytes of K+V it reads anyway), and the lse comes out of the split
merge; the second pass is a streaming `exp2(s - lse)` plus a mean over heads: no K, no V,
no PV product. For prefill the window rows' logits are recomputed from K (W*g rows, a
thin QK^T with no V and no online rescaling), given the rows' lse from the prefill
attention (`paged_prefill_triton(..., return_lse=True)`); without it a first pass over K
computes the lse.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import LOG2E, cdiv, check_cache, check_launch, lazy_jit, next_pow2
from .paged_decode import MODE_DENSE, split_k_decode
from .window_rows import paged_key_tile, window_key_probs, window_rows

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def decode_colsum_ref(q, k_cache, v_cache, page_table, kv_lens, max_kv_len=None, scale=None):
    """-> (out `[B, Hq, d]`, colsum `[B, Hkv, max_kv_len]` fp32)."""
    B, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    out = torch.zeros(B, Hq, d, dtype=torch.float32, device=q.device)
    colsum = torch.zeros(B, Hkv, L, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(kv_lens[b])
        tokens = torch.arange(n, device=q.device)
        k = _common.gather_tokens(k_cache, page_table[b], tokens).float()
        v = _common.gather_tokens(v_cache, page_table[b], tokens).float()
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            p = torch.softmax((q[b, heads].float() @ k[:, h].T) * scale, dim=-1)
            out[b, heads] = p @ v[:, h]
            colsum[b, h, :n] = p.mean(0)[:L]
    return out.to(q.dtype), colsum


def decode_colsum_triton(q, k_cache, v_cache, page_table, kv_lens, max_kv_len=None, scale=None,
                         *, kv_chunk=None, balanced=None, counters=None):
    B, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    device = check_launch(q, k_cache, v_cache, page_table, kv_lens)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    logits = _common.empty((B, Hq, max(L, 1)), torch.float32, device)
    capacity = min(page_table.shape[1] * page_size, max(L, 1))  # L bounds every row: no empty splits
    out, lse = split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=MODE_DENSE,
                              capacity=capacity, scale=scale, return_lse=True,
                              kv_chunk=kv_chunk, logits=logits, balanced=balanced, counters=counters)
    colsum = _common.empty((B, Hkv, L), torch.float32, device)
    g = Hq // Hkv
    block_n = 128
    _probs_colsum_kernel[(B * Hkv, cdiv(max(L, 1), block_n))](
        logits, lse, kv_lens, colsum, L, logits.shape[-1], Hkv, Hq,
        GROUP=g, BLOCK_H=next_pow2(g), BLOCK_N=block_n, num_warps=4,
    )
    return out, colsum


def prefill_window_colsum_ref(q, k_cache, page_table, kv_lens, cu_q_lens, window, max_kv_len=None,
                              scale=None, lse=None):
    """-> scores `[B, Hkv, max_kv_len]` fp32. `lse` is accepted for signature parity, unused."""
    T, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    B = page_table.shape[0]
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    scores = torch.zeros(B, Hkv, L, dtype=torch.float32, device=q.device)
    for b in range(B):
        start, q_len, n = int(cu_q_lens[b]), int(cu_q_lens[b + 1] - cu_q_lens[b]), int(kv_lens[b])
        w = min(window, q_len)
        rows = torch.arange(q_len - w, q_len, device=q.device)
        pos = n - q_len + rows
        k = _common.gather_tokens(k_cache, page_table[b], torch.arange(n, device=q.device)).float()
        causal = torch.arange(n, device=q.device)[None, :] <= pos[:, None]
        for h in range(Hkv):
            qw = q[start + rows, h * g:(h + 1) * g].float()  # [w, g, d]
            s = torch.einsum("wgd,nd->gwn", qw, k[:, h]) * scale
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            scores[b, h, :n] = (p.sum(dim=(0, 1)) / g)[:L]
    return scores


def prefill_window_colsum_triton(q, k_cache, page_table, kv_lens, cu_q_lens, window, max_kv_len=None,
                                 scale=None, lse=None):
    T, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    device = check_launch(q, k_cache, page_table, kv_lens, cu_q_lens)
    _common.check_dtypes(q, k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, g = page_table.shape[0], Hq // Hkv
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    g_pad, w_pad = next_pow2(g), next_pow2(window)
    block_r = max(16, min(64, w_pad * g_pad))
    block_d = max(16, next_pow2(d))
    common = dict(GROUP=g, G_PAD=g_pad, WINDOW=window, BLOCK_R=block_r, HEAD_DIM=d, BLOCK_D=block_d,
                  PAGE_SIZE=page_size, BLOCK_N=64, DOT_PREC=_common.dot_precision(q.dtype), num_warps=4)
    args = (q, k_cache, page_table, kv_lens, cu_q_lens, _common.default_scale(d, scale) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            page_table.stride(0), Hkv, Hq)
    if lse is not None:
        lse = lse.float().contiguous()
    else:
        lse = _common.empty((T, Hq), torch.float32, device)
        _window_lse_kernel[(B, Hkv, cdiv(w_pad * g_pad, block_r))](*args, lse, **common)
    scores = _common.empty((B, Hkv, L), torch.float32, device)
    _window_colsum_kernel[(B, Hkv, cdiv(max(L, 1), 64))](*args, lse, scores, L,
                                                         W_ROWS=w_pad * g_pad, **common)
    return scores


@lazy_jit
def _probs_colsum_kernel(logits_ptr, lse_ptr, kv_lens_ptr, colsum_ptr, L, logits_len, HKV, HQ,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    hq = kvh * GROUP + offs_h
    lse = tl.load(lse_ptr + b * HQ + hq, mask=h_mask, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    valid = (offs_n < tl.load(kv_lens_ptr + b)) & (offs_n < logits_len)
    s = tl.load(logits_ptr + (b * HQ + hq)[:, None] * logits_len + offs_n[None, :],
                mask=h_mask[:, None] & valid[None, :], other=float("-inf"))
    col = tl.sum(tl.exp2(s - lse[:, None]), 0) / GROUP
    tl.store(colsum_ptr + pid_bh * L + offs_n, col, mask=offs_n < L)


@lazy_jit
def _window_lse_kernel(
    q_ptr, k_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_pt, HKV, HQ, lse_ptr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, WINDOW: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    w_eff = tl.minimum(q_len, WINDOW)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok, pos, hq, t = window_rows(offs_r, w_eff, q_len, kv_len, q_start, kvh, GROUP, G_PAD)
    q = tl.load(q_ptr + t[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        k = paged_key_tile(k_ptr, page_table_ptr + b * stride_pt, offs_n, n_ok, kvh, stride_kp, stride_ko,
                           stride_kh, offs_d, offs_d < HEAD_DIM, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * HQ + hq, lse * 0.6931471805599453, mask=row_ok)


@lazy_jit
def _window_colsum_kernel(
    q_ptr, k_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_pt, HKV, HQ, lse_ptr, scores_ptr, L,
    W_ROWS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    w_eff = tl.minimum(q_len, WINDOW)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    k = paged_key_tile(k_ptr, page_table_ptr + b * stride_pt, offs_n, n_ok, kvh, stride_kp, stride_ko, stride_kh,
                       offs_d, d_ok, PAGE_SIZE)
    col = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, W_ROWS, BLOCK_R):
        p, ok, _, _ = window_key_probs(k, offs_n, n_ok, r0 + tl.arange(0, BLOCK_R), q_ptr, lse_ptr, w_eff, q_len,
                                       kv_len, q_start, kvh, qk_scale, stride_qt, stride_qh, offs_d, d_ok, HQ,
                                       GROUP, G_PAD, DOT_PREC)
        col += tl.sum(tl.where(ok, p, 0.0), 0)
    tl.store(scores_ptr + (b * HKV + kvh) * L + offs_n, col / GROUP, mask=offs_n < L)
